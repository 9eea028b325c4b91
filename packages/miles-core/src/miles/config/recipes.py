"""Finding recipes: built-in names, directories on ``MILES_RECIPE_PATH``, or a YAML file path.

A name (``default``) is looked up as ``NAME.yaml`` in each directory of
``MILES_RECIPE_PATH`` (``os.pathsep``-separated, searched first, like ``PATH``) and then
among the recipes shipped in ``miles/recipes/``. Anything with a ``/`` or a
``.yaml``/``.yml`` suffix is a file path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from miles._plugins.discovery import did_you_mean
from miles.errors import ConfigError

RECIPE_PATH_ENV = "MILES_RECIPE_PATH"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class RecipeSource:
    """Where a recipe's text came from."""

    ref: str  # what ``config.recipe`` records: the name, or the file's absolute path
    display: str  # how messages refer to the file (``default.yaml``, ``./my.yaml``)
    text: str


@dataclass(frozen=True)
class RecipeInfo:
    name: str
    description: str  # the recipe's first comment line
    location: str  # ``built-in`` or the directory it was found in


def recipe_dirs() -> list[tuple[str, Traversable]]:
    """``(label, directory)`` in search order: ``MILES_RECIPE_PATH`` entries, then the built-ins."""
    dirs: list[tuple[str, Traversable]] = [
        (entry, Path(entry))
        for entry in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep)
        if entry.strip()
    ]
    dirs.append(("built-in", resources.files("miles").joinpath("recipes")))
    return dirs


def _recipe_files() -> list[tuple[str, str, Traversable]]:
    """``(name, location label, file)`` for every visible recipe; earlier directories win."""
    seen: dict[str, tuple[str, str, Traversable]] = {}
    for label, directory in recipe_dirs():
        if not directory.is_dir():
            continue
        for item in sorted(directory.iterdir(), key=lambda t: t.name):
            if item.is_file() and item.name.endswith(".yaml"):
                seen.setdefault(item.name[: -len(".yaml")], (item.name[: -len(".yaml")], label, item))
    return sorted(seen.values(), key=lambda t: t[0])


def list_recipes() -> list[RecipeInfo]:
    return [
        RecipeInfo(name, _first_comment(item.read_text(encoding="utf-8")), label)
        for name, label, item in _recipe_files()
    ]


def _first_comment(text: str) -> str:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            return stripped.lstrip("#").strip()
        if stripped:
            break
    return ""


def _looks_like_path(ref: str) -> bool:
    return "/" in ref or os.sep in ref or ref.endswith((".yaml", ".yml"))


def find_recipe(ref: str) -> RecipeSource:
    """The recipe ``ref`` names (a recipe name or a YAML file path)."""
    if not isinstance(ref, str) or not ref.strip():
        raise ConfigError(
            "a recipe is a name (see `miles recipes`) or a path to a YAML file; got an empty string"
        )
    if not _looks_like_path(ref):
        for name, label, item in _recipe_files():
            if name == ref:
                display = f"{name}.yaml" if label == "built-in" else str(Path(label) / f"{name}.yaml")
                return RecipeSource(ref=name, display=display, text=item.read_text(encoding="utf-8"))
        if not Path(ref).is_file():
            names = [name for name, _, _ in _recipe_files()]
            hint = did_you_mean(ref, names)
            available = ", ".join(names) or "none"
            suffix = "" if _NAME.match(ref) else "; to load a file, give its path (e.g. ./recipe.yaml)"
            raise ConfigError(
                f"no recipe named {ref!r}{hint or '.'} Available: {available} "
                f"(built-in and {RECIPE_PATH_ENV}); or give a path to a YAML file{suffix}"
            )
    path = Path(ref).expanduser()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"recipe file {ref!r} {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read recipe file {ref!r}: {err}") from None
    return RecipeSource(ref=str(path.resolve()), display=ref, text=text)
