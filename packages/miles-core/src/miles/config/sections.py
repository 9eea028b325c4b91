"""Typed records plugins return from ``miles_config_sections``."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel


@dataclass(frozen=True, kw_only=True)
class ConfigSection:
    """A top-level recipe key owned by a plugin, validated by ``model``."""

    name: str
    model: type[BaseModel]
    description: str = ""
    # Keys of this section (dotted, relative to it) that may change when a run resumes; a
    # resume that changes any other key is refused (``miles.config.resume``).
    resume_mutable: frozenset[str] = frozenset()
