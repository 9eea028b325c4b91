"""Hooks the Megatron backend contributes to every run: its ``megatron`` section and its refusals.

``miles_configure`` is the first thing a run's pre-flight (and ``miles config validate --check``)
calls, so a recipe with ``backend: megatron`` that cannot run here is refused in one line before
anything starts. Nothing here imports megatron-core: the check looks it up without importing it,
and a run with another backend pays for none of this.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from miles import hookimpl
from miles.config.sections import ConfigSection
from miles.errors import ConfigError
from miles_megatron.config import MegatronOptions


@hookimpl
def miles_config_sections() -> list[ConfigSection]:
    return [
        ConfigSection(
            name="megatron",
            model=MegatronOptions,
            description="Megatron-core training backend: parallel layout (TP, PP, CP, EP, ETP), device",
        )
    ]


@hookimpl
def miles_configure(config: Any) -> None:
    if config.backend != "megatron":
        return
    options = getattr(config, "megatron", None) or MegatronOptions()
    from miles_megatron.layout import plan_layout

    # The recipe's own mistakes first (on any machine), then what this machine lacks. Sizes that
    # cannot divide the world are refused here, the model's shape when the backend is set up.
    plan_layout(options)
    if options.num_ranks != 1:
        raise ConfigError(
            f"megatron.num_ranks is {options.num_ranks}: the megatron backend trains on one GPU so far "
            "(multi-GPU runs are the multi-GPU issue's)"
        )
    problem = runtime_problem()
    if problem is not None:
        raise ConfigError(problem)


def runtime_problem() -> str | None:
    """Why megatron-core cannot train on this machine (one sentence), or None when it can."""
    try:  # the distribution's metadata, so that checking imports nothing of megatron
        importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "backend 'megatron' needs megatron-core: pip install miles-megatron"
    import torch

    if not torch.cuda.is_available():
        return (
            "backend 'megatron' needs a CUDA GPU and none is visible on this machine "
            "(megatron-core trains on CUDA only); use backend: fsdp to train on CPU"
        )
    return None
