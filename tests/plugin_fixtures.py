"""Fake installed distributions for plugin tests: real ``*.dist-info`` directories on ``sys.path``.

Nothing in miles is mocked: ``importlib.metadata`` and stevedore find these
distributions exactly as they find installed ones.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles.plugins import reset_plugin_state


class FakeSite:
    """A directory on ``sys.path`` to which tests add distributions and modules."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: set[str] = set()

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
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        sections = []
        for group, entries in entry_points.items():
            lines = "\n".join(f"{key} = {value}" for key, value in entries.items())
            sections.append(f"[{group}]\n{lines}\n")
        (info / "entry_points.txt").write_text("\n".join(sections))
        importlib.invalidate_caches()
        reset_plugin_state()

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
    for name in list(sys.modules):
        if name.split(".")[0] in site.modules:
            del sys.modules[name]
    reset_plugin_state()
