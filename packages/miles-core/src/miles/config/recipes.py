"""Finding recipes: built-in names, plugins' recipes, directories on ``MILES_RECIPE_PATH``, or a YAML file.

A name (``default``) is looked up as ``NAME.yaml`` in each directory of
``MILES_RECIPE_PATH`` (``os.pathsep``-separated, searched first, like ``PATH``), then
among the recipes shipped in ``miles/recipes/``, then in the recipe directories installed
distributions declare (an entry point in the ``miles.recipes`` group whose value is a package
holding ``NAME.yaml`` files). A name that the built-ins and a plugin, or two plugins, both
ship is refused naming both. Anything with a ``/`` or a ``.yaml``/``.yml`` suffix is a file path.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from miles._plugins.discovery import did_you_mean
from miles.errors import ConfigError

RECIPE_PATH_ENV = "MILES_RECIPE_PATH"
# Distributions declare a directory of recipes here: ``name = "package.with.yaml.files"``.
RECIPES_GROUP = "miles.recipes"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_BUILTIN = "built-in"

log = logging.getLogger(__name__)


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
    """``(label, directory)`` in search order: ``MILES_RECIPE_PATH`` entries, the built-ins, then the
    plugins' recipe directories (labelled with their distribution and version)."""
    return [*_user_dirs(), (_BUILTIN, resources.files("miles").joinpath("recipes")), *plugin_recipe_dirs()]


def _user_dirs() -> list[tuple[str, Traversable]]:
    return [
        (entry, Path(entry))
        for entry in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep)
        if entry.strip()
    ]


def plugin_recipe_dirs() -> list[tuple[str, Traversable]]:
    """The recipe directories installed distributions declare (``miles.recipes``), by distribution.

    Only the declaring package is imported (to find its directory). One that cannot be found is
    skipped with a warning: a broken plugin never stops ``miles`` from starting.
    """
    from importlib.metadata import entry_points

    found: dict[str, tuple[str, Traversable]] = {}
    for ep in sorted(entry_points(group=RECIPES_GROUP), key=lambda e: (e.value, e.name)):
        package = ep.value.partition(":")[0].strip()
        if package in found:  # one distribution seen twice on sys.path (an editable checkout)
            continue
        dist = ep.dist
        label = f"{dist.metadata['Name']} {dist.version}" if dist is not None else ep.name
        try:
            directory = resources.files(package)
        except (ImportError, TypeError, ValueError) as err:
            log.warning("recipes of %s (%s = %r) cannot be found: %s", label, ep.name, ep.value, err)
            continue
        found[package] = (label, directory)
    return list(found.values())


def _recipe_files() -> list[tuple[str, str, Traversable]]:
    """``(name, location label, file)`` for every visible recipe; earlier directories win."""
    return sorted(_visible()[0].values(), key=lambda t: t[0])


def _visible() -> tuple[dict[str, tuple[str, str, Traversable]], dict[str, list[str]]]:
    """The recipe each name finds, and the names that the built-ins and plugins ship more than once
    (``name -> labels``). A ``MILES_RECIPE_PATH`` directory shadows them on purpose, like ``PATH``."""
    seen: dict[str, tuple[str, str, Traversable]] = {}
    shipped: dict[str, list[str]] = {}
    user = {label for label, _ in _user_dirs()}
    for label, directory in recipe_dirs():
        if not directory.is_dir():
            continue
        for item in sorted(directory.iterdir(), key=lambda t: t.name):
            if item.is_file() and item.name.endswith(".yaml"):
                name = item.name[: -len(".yaml")]
                seen.setdefault(name, (name, label, item))
                if label not in user:
                    shipped.setdefault(name, []).append(label)
    clashes = {name: labels for name, labels in shipped.items() if len(labels) > 1}
    return seen, clashes


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
        visible, clashes = _visible()
        if ref in visible:
            name, label, item = visible[ref]
            if ref in clashes and label in clashes[ref]:
                raise ConfigError(
                    f"recipe {ref!r} is shipped by {' and by '.join(clashes[ref])}; uninstall one, or give the "
                    f"file's path (or put the one you mean in a directory on {RECIPE_PATH_ENV})"
                )
            user = label in {lbl for lbl, _ in _user_dirs()}
            display = str(Path(label) / f"{name}.yaml") if user else f"{name}.yaml"
            return RecipeSource(ref=name, display=display, text=item.read_text(encoding="utf-8"))
        if not Path(ref).is_file():
            names = [name for name, _, _ in _recipe_files()]
            hint = did_you_mean(ref, names)
            available = ", ".join(names) or "none"
            suffix = "" if _NAME.match(ref) else "; to load a file, give its path (e.g. ./recipe.yaml)"
            raise ConfigError(
                f"no recipe named {ref!r}{hint or '.'} Available: {available} "
                f"(built-in, installed plugins and {RECIPE_PATH_ENV}); or give a path to a YAML file{suffix}"
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
