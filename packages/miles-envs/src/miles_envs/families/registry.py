"""The family registry: the user names a family at launch; it is never guessed from a checkpoint.

``register_family`` is the single way in (built-ins, and plugins from the module their
``miles.plugins`` entry point names, which is imported before any recipe is validated).
``get_family`` returns the registration; an unknown name is a ``FamilyError`` with a "did
you mean", like every other wrong name in a recipe, and ``agentic.family`` is checked with
``check_family_name`` when the recipe is validated. The ``generic`` family (the tokenizer's
own template, best-effort parsing) is used only when it is named: rendering suffixes with an
unverified template can diverge from the template's own output, so it is never a fallback.
"""

from __future__ import annotations

import threading

from miles_envs.families.base import FamilyError, ModelFamily

GENERIC = "generic"

_FAMILIES: dict[str, ModelFamily] = {}
_LOCK = threading.Lock()
_BUILTIN_LOCK = threading.Lock()
_BUILTINS_LOADED = False


def register_family(name: str, family: ModelFamily, *, replace: bool = False) -> None:
    """Register ``family`` under ``name``; a second registration of a name is an error unless ``replace``.

    The built-in families are registered first, so a name that shadows one needs ``replace=True``.
    """
    _ensure_builtins()
    _register(name, family, replace=replace)


def _register(name: str, family: ModelFamily, *, replace: bool) -> None:
    if not isinstance(name, str) or not name.strip():
        raise FamilyError("a family name must be a non-empty string")
    if not isinstance(family, ModelFamily):
        raise FamilyError(f"family {name!r}: expected a ModelFamily, got {type(family).__name__}")
    if family.name != name:
        raise FamilyError(f"family registered as {name!r} calls itself {family.name!r}")
    with _LOCK:
        if name in _FAMILIES and not replace:
            raise FamilyError(f"a family named {name!r} is already registered")
        _FAMILIES[name] = family


def _ensure_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    with _BUILTIN_LOCK:
        if _BUILTINS_LOADED:
            return
        from miles_envs.families.builtin import BUILTIN_FAMILIES

        for family in BUILTIN_FAMILIES:
            _register(family.name, family, replace=False)
        _BUILTINS_LOADED = True


def registered_families() -> list[str]:
    """Names of the registered families (built-ins included), sorted."""
    _ensure_builtins()
    return sorted(_FAMILIES)


def is_registered(name: str) -> bool:
    _ensure_builtins()
    return name in _FAMILIES


def get_family(name: str) -> ModelFamily:
    """The family registered as ``name``; an unknown name is a ``FamilyError`` naming the registered ones."""
    _ensure_builtins()
    family = _FAMILIES.get(name)
    if family is None:
        raise FamilyError(_unknown(name))
    return family


def check_family_name(name: str) -> str:
    """``name`` if a family is registered under it, else a ``FamilyError`` with "did you mean".

    Before refusing a name, the installed hook plugins are imported (the process's plugin
    manager), since a plugin registers its families when its hook module is imported and a
    config may be validated before anything else built the manager.
    """
    if is_registered(name):
        return name
    from miles.plugins import get_plugin_manager

    get_plugin_manager()
    if is_registered(name):
        return name
    raise FamilyError(_unknown(name))


def _unknown(name: str) -> str:
    from miles._plugins.discovery import did_you_mean

    names = sorted(_FAMILIES)
    return (
        f"model family {name!r} is not registered{did_you_mean(name, names)} (registered: "
        f"{', '.join(names)}; {GENERIC!r} renders with the tokenizer's own template, unverified; "
        "docs/model-families.md says how to register one)"
    )
