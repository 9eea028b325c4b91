"""``--set a.b=c`` overrides: parsed as YAML values and applied to the recipe's mapping."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from miles.config.yaml_io import parse_value
from miles.errors import ConfigError


@dataclass(frozen=True)
class Override:
    path: tuple[str, ...]
    value: Any
    text: str  # as the user wrote it, for messages

    @property
    def key(self) -> str:
        return ".".join(self.path)


def parse_override(text: str) -> Override:
    """``rollout.temperature=0.7`` -> ``Override(("rollout", "temperature"), 0.7)``.

    Values are YAML: ``null``, ``true``, ``[]``, ``[a, b]``, ``{k: v}``, numbers; an empty value is ``null``.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set rollout.temperature=0.7")
    path = tuple(part.strip() for part in key.split("."))
    if any(not part for part in path):
        raise ConfigError(f"--set {text!r}: {key!r} has an empty part; keys look like section.key")
    try:
        value = parse_value(raw)
    except ConfigError as err:
        raise ConfigError(f"--set {text!r}: {err}") from None
    return Override(path, value, text)


def apply_overrides(data: dict[str, Any], overrides: Iterable[Override]) -> dict[str, Any]:
    """A copy of ``data`` with each override set, creating missing sections on the way."""
    result = copy.deepcopy(data)
    for override in overrides:
        node: dict[str, Any] = result
        for depth, part in enumerate(override.path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(override.path[: depth + 1])
                raise ConfigError(
                    f"--set {override.text!r}: {where!r} is a value ({type(child).__name__} {child!r}), not a section"
                )
            node = child
        node[override.path[-1]] = override.value
    return result
