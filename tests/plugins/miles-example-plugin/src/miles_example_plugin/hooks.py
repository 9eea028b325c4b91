"""Hooks of the example plugin: an ``example`` recipe section, applied when the run is configured."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import miles_example_plugin
from miles import hookimpl
from miles.config.sections import ConfigSection


class ExampleOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_length: int = Field(
        8, ge=1, description="response length (tokens) the length_penalty reward aims for"
    )


@hookimpl
def miles_config_sections() -> list[ConfigSection]:
    return [
        ConfigSection(
            name="example", model=ExampleOptions, description="the example plugin's reward settings"
        )
    ]


@hookimpl
def miles_configure(config: Any) -> None:
    section = getattr(config, "example", None)
    if isinstance(section, ExampleOptions):
        miles_example_plugin.target_length = section.target_length
