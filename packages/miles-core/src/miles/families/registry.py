"""The family registry: the user names a family at launch; it is never guessed from a checkpoint.

``register_family`` is the single way in (built-ins and, later, plugins use it). ``get_family``
returns the registration; an unknown name falls back to the ``generic`` family with a warning
that names the registered ones, because rendering suffixes with an unverified template can
diverge from the template's own output.
"""

from __future__ import annotations

import logging
import threading

from miles.families.base import FamilyError, ModelFamily

logger = logging.getLogger(__name__)

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
        from miles.families.builtin import BUILTIN_FAMILIES

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
    """The family registered as ``name``; an unknown name gets the generic family and a warning."""
    _ensure_builtins()
    family = _FAMILIES.get(name)
    if family is not None:
        return family
    known = ", ".join(n for n in sorted(_FAMILIES) if n != GENERIC)
    logger.warning(
        "model family %r is not registered; using the generic family (the tokenizer's own template, "
        "best-effort parsing): incremental tokenization may diverge from the template. Registered families: %s",
        name,
        known,
    )
    return _FAMILIES[GENERIC]
