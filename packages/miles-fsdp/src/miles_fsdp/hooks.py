"""Hooks the FSDP backend contributes to every run: its ``fsdp`` recipe section and placement checks."""

from __future__ import annotations

from typing import Any

from miles import hookimpl
from miles.config.sections import ConfigSection
from miles.errors import ConfigError
from miles_fsdp.config import FSDPOptions


@hookimpl
def miles_config_sections() -> list[ConfigSection]:
    return [
        ConfigSection(
            name="fsdp",
            model=FSDPOptions,
            description="FSDP2 training backend: ranks, device, mixed precision, checkpointing",
            # The checkpoint is a sharding-independent DCP snapshot in the parameters' own dtype, so
            # every setting here may change when a run resumes.
            resume_mutable=frozenset(FSDPOptions.model_fields),
        )
    ]


@hookimpl
def miles_configure(config: Any) -> None:
    """Refuse placements that cannot run: NCCL cannot join two processes on one GPU; LoRA over a
    transport that cannot carry an adapter."""
    _check_lora_transport(config)
    options = getattr(config, "fsdp", None)
    if config.backend != "fsdp" or options is None or options.device != "cuda":
        return
    engine_device = config.engine.device
    if config.transport != "broadcast" or not engine_device.startswith("cuda") or config.engine.urls:
        return
    engine_gpu = int(engine_device.split(":", 1)[1]) if ":" in engine_device else 0
    if engine_gpu < options.num_ranks:
        raise ConfigError(
            f"transport 'broadcast' needs the engines on a GPU no trainer rank uses: engine.device is "
            f"{engine_device!r} and fsdp.num_ranks={options.num_ranks} trains on cuda:0..cuda:{options.num_ranks - 1} "
            f"(NCCL cannot connect two processes on one GPU); set engine.device=cuda:{options.num_ranks} "
            "or use transport: colocated"
        )


def _check_lora_transport(config: Any) -> None:
    if getattr(config, "lora", None) is None or config.backend != "fsdp" or config.mode != "rl":
        return
    from miles._plugins.components import load_component
    from miles.lora import transport_refusal

    transport = load_component("transport", config.transport)
    if not getattr(transport, "carries_adapters", False):
        raise ConfigError(transport_refusal(config.transport))
