"""Installed distributions for plugin tests: real ``*.dist-info`` directories on ``sys.path``.

Nothing in miles is mocked: ``importlib.metadata`` and stevedore find these
distributions exactly as they find installed ones.

- ``fake_site``: an empty site for one test, to which it adds throw-away distributions.
- ``fixture_plugins`` / ``fixture_plugins_for_module``: the fixture distributions kept in
  ``tests/plugins`` (``miles-example-plugin``, ``miles-broken-plugin``) installed the way an
  editable install does, for one test or one module. They are not in the workspace's
  environment, so a developer's ``miles`` never sees them; a test that needs them asks for one
  of these fixtures, which also puts them on ``PYTHONPATH`` for the processes it starts (the
  ``miles`` command, trainer ranks, engines).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.plugins import reset_plugin_state

PLUGIN_PROJECTS = Path(__file__).parent / "plugins"
FIXTURE_PLUGINS = ("miles-example-plugin", "miles-broken-plugin")


class FakeSite:
    """A directory on ``sys.path`` to which tests add distributions and modules."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: set[str] = set()
        self.source_dirs: list[Path] = []  # the import roots of projects installed from source

    def module(self, name: str, source: str) -> None:
        """Write module ``name`` (dotted names become packages)."""
        parts = name.split(".")
        directory = self.root
        for package in parts[:-1]:
            directory = directory / package
            directory.mkdir(exist_ok=True)
            (directory / "__init__.py").touch()
        (directory / f"{parts[-1]}.py").write_text(textwrap.dedent(source))
        self.modules.add(parts[0])
        importlib.invalidate_caches()

    def dist(self, name: str, version: str, entry_points: dict[str, dict[str, str]]) -> None:
        """Declare distribution ``name`` with ``{group: {entry name: "module:attr"}}``."""
        info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        sections = []
        for group, entries in entry_points.items():
            lines = "\n".join(f"{key} = {value}" for key, value in entries.items())
            sections.append(f"[{group}]\n{lines}\n")
        _write_if_changed(info / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        _write_if_changed(info / "entry_points.txt", "\n".join(sections))
        importlib.invalidate_caches()
        reset_plugin_state()

    def install_project(self, project: Path) -> None:
        """Install the source tree ``project`` (a ``src/`` layout) as an editable install does.

        Its ``*.dist-info`` (name, version and entry points read from its own ``pyproject.toml``)
        goes into this site, and its ``src`` directory joins ``import_paths``; nothing is copied,
        so the modules imported are the ones in the repository.
        """
        meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
        self.dist(meta["name"], meta["version"], meta.get("entry-points", {}))
        source = project / "src"
        self.source_dirs.append(source)
        self.modules.update(p.name for p in source.iterdir() if (p / "__init__.py").is_file())

    @property
    def import_paths(self) -> list[Path]:
        """What goes on ``sys.path`` (and ``PYTHONPATH``) for the site to be installed."""
        return [self.root, *self.source_dirs]

    def forget_modules(self) -> None:
        """Drop the site's modules from ``sys.modules``, so later tests import nothing stale."""
        for name in list(sys.modules):
            if name.split(".")[0] in self.modules:
                del sys.modules[name]

    def imported(self, module: str) -> bool:
        return module in sys.modules


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSite]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    # stevedore caches entry points on disk (~/.cache/python-entrypoints) keyed by sys.path;
    # keep the caches of these throw-away paths out of the home directory.
    import stevedore._cache

    monkeypatch.setattr(stevedore._cache._c, "_dir", str(tmp_path / "entrypoint-cache"), raising=False)
    reset_plugin_state()
    site = FakeSite(root)
    yield site
    site.forget_modules()
    reset_plugin_state()


def _write_if_changed(path: Path, text: str) -> None:
    # An unchanged file keeps its mtime, and with it stevedore's on-disk cache key (a hash of
    # sys.path and the mtimes of its entry_points.txt files); the replace is atomic for
    # concurrent test sessions that share the site.
    if path.is_file() and path.read_text() == text:
        return
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    partial.replace(path)


@pytest.fixture(scope="session")
def fixture_plugin_site(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FakeSite:
    """The fixture distributions of ``tests/plugins`` installed into a site that is not on ``sys.path``.

    The site lives in pytest's cache directory under a name derived from the projects'
    ``pyproject.toml`` files, so it keeps one path from session to session: stevedore's
    entry-point cache (one file per distinct ``sys.path``, in ~/.cache, also written by every
    subprocess) then gets no new file per test session.
    """
    projects = [PLUGIN_PROJECTS / name for name in FIXTURE_PLUGINS]
    digest = hashlib.sha256(b"".join((p / "pyproject.toml").read_bytes() for p in projects)).hexdigest()
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    parent = (
        cache.mkdir("fixture-plugins") if cache is not None else tmp_path_factory.mktemp("fixture-plugins")
    )
    root = parent / digest[:16]
    root.mkdir(exist_ok=True)
    site = FakeSite(root)
    for project in projects:
        site.install_project(project)
    return site


@contextlib.contextmanager
def _installed(site: FakeSite) -> Iterator[FakeSite]:
    patch = pytest.MonkeyPatch()
    try:
        for path in reversed(site.import_paths):
            patch.syspath_prepend(str(path))
        inherited = os.environ.get("PYTHONPATH")
        patch.setenv(
            "PYTHONPATH", os.pathsep.join([*map(str, site.import_paths), *filter(None, [inherited])])
        )
        reset_plugin_state()
        yield site
    finally:
        patch.undo()
        site.forget_modules()
        reset_plugin_state()


@pytest.fixture
def fixture_plugins(fixture_plugin_site: FakeSite) -> Iterator[FakeSite]:
    """The fixture plugins installed for one test (in this process and the ones it starts)."""
    with _installed(fixture_plugin_site) as site:
        yield site


@pytest.fixture(scope="module")
def fixture_plugins_for_module(fixture_plugin_site: FakeSite) -> Iterator[FakeSite]:
    """The fixture plugins installed for every test of a module (for module-scoped fixtures using them)."""
    with _installed(fixture_plugin_site) as site:
        yield site
