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
