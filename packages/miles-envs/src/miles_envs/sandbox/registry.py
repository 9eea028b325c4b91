"""Finding a sandbox provider by name: the ``miles.sandbox_providers`` entry-point group.

A distribution declares a provider class the way transports declare theirs::

    [project.entry-points."miles.sandbox_providers"]
    local-dir = "miles_envs.sandbox.local:LocalProvider"

and a recipe names it (``local-dir``) or gives an import path (``pkg.module:Class``). The class's
``Options`` (a :class:`miles.capabilities.ComponentOptions` model) validates the recipe's options
before the class is built, so a typo is one error naming the option, not a ``TypeError`` later.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from miles.errors import ComponentError, ConfigError
from miles_envs.sandbox.base import SandboxProvider

PROVIDERS_GROUP = "miles.sandbox_providers"


def _entries(name: str | None = None) -> list[importlib.metadata.EntryPoint]:
    found: dict[tuple[str, str], importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=PROVIDERS_GROUP):
        if name is None or ep.name == name:
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            found.setdefault(
                (ep.name, dist.lower().replace("_", "-")), ep
            )  # one checkout seen twice is one provider
    return list(found.values())


def provider_names() -> list[str]:
    """The installed provider names."""
    return sorted({ep.name for ep in _entries()})


def load_provider_class(ref: str) -> type:
    """The class that ``ref`` (an installed name or ``package.module:Class``) points at."""
    if not isinstance(ref, str) or not ref.strip():
        raise ComponentError(f"sandbox provider must be a name or 'package.module:Class', got {ref!r}")
    if ":" in ref:
        module_name, _, attr = ref.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as err:
            raise ComponentError(
                f"sandbox provider {ref!r} cannot be imported: {type(err).__name__}: {err}"
            ) from err
    else:
        entries = _entries(ref)
        if not entries:
            installed = provider_names()
            close = difflib.get_close_matches(ref, installed, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ComponentError(
                f"no sandbox provider named {ref!r}{hint} Installed ({PROVIDERS_GROUP}): "
                f"{', '.join(installed) or 'none'}. A provider can also be given as 'package.module:Class'."
            )
        if len(entries) > 1:
            listed = ", ".join(f"{ep.dist.name if ep.dist else '?'} ({ep.value})" for ep in entries)
            raise ComponentError(
                f"sandbox provider {ref!r} is provided by {len(entries)} distributions: {listed}"
            )
        try:
            obj = entries[0].load()
        except Exception as err:
            dist = entries[0].dist
            label = f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"
            raise ComponentError(
                f"sandbox provider {ref!r} from {label} failed to import ({entries[0].value}): {type(err).__name__}: {err}"
            ) from err
    if not isinstance(obj, type):
        raise ComponentError(f"sandbox provider {ref!r} must be a class, got {type(obj).__name__}")
    return obj


def make_provider(ref: str, options: Mapping[str, Any] | None = None) -> SandboxProvider:
    """Build the provider ``ref`` with the recipe's ``options`` (validated by its ``Options`` model)."""
    cls = load_provider_class(ref)
    values = dict(options or {})
    model = getattr(cls, "Options", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        try:
            validated = model.model_validate(values)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(options)'}: {e['msg']}" for e in err.errors()
            )
            raise ConfigError(f"sandbox provider {ref!r} rejected its options: {problems}") from None
        values = {name: getattr(validated, name) for name in type(validated).model_fields}
    provider = cls(**values)
    if not isinstance(provider, SandboxProvider):
        raise ComponentError(
            f"sandbox provider {ref!r} ({cls.__qualname__}) does not implement SandboxProvider"
        )
    return provider
