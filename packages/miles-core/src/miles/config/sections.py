"""Typed records plugins return from ``miles_config_sections``, and a backend's sections of its spec."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    from miles.config.schema import TrainSection

SectionT = TypeVar("SectionT", bound=BaseModel)


@dataclass(frozen=True, kw_only=True)
class ConfigSection:
    """A top-level recipe key owned by a plugin, validated by ``model``."""

    name: str
    model: type[BaseModel]
    description: str = ""
    # Keys of this section (dotted, relative to it) that may change when a run resumes; a
    # resume that changes any other key is refused (``miles.config.resume``).
    resume_mutable: frozenset[str] = frozenset()


def backend_sections(
    options: Mapping[str, Any], backend: str, model: type[SectionT]
) -> tuple[TrainSection, SectionT]:
    """The ``train`` section and the backend's own (``options[backend]``, validated by ``model``) of a
    ``BackendSpec``'s options; any other section is refused. One ConfigError names what is wrong."""
    from miles.config.schema import TrainSection
    from miles.errors import ConfigError

    try:
        train = TrainSection.model_validate(options.get("train", {}))
        own = model.model_validate(options.get(backend, {}))
    except ValidationError as exc:
        raise ConfigError(f"{backend} backend options are invalid: {exc}") from exc
    unknown = set(options) - {"train", backend}
    if unknown:
        raise ConfigError(
            f"{backend} backend options: unknown section(s) {sorted(unknown)}; allowed: train, {backend}"
        )
    return train, own
