"""Hooks the FSDP backend contributes to every run: its ``fsdp`` recipe section."""

from __future__ import annotations

from miles import hookimpl
from miles.config.sections import ConfigSection
from miles_fsdp.config import FSDPOptions


@hookimpl
def miles_config_sections() -> list[ConfigSection]:
    return [
        ConfigSection(
            name="fsdp",
            model=FSDPOptions,
            description="FSDP2 training backend: ranks, device, mixed precision, checkpointing",
        )
    ]
