"""What a diffusion SFT recipe (``mode: sft``, ``backend: diffusion``) may not ask for, refused before
anything starts with one line each.

The core skips the engine-side checks in supervised mode (no engines start), so these run from
``miles_configure``. That the data source yields images and the backend trains them is the core's own
check (``SupervisedSampleSource.sample_kind`` against the backend's ``supervised_kinds``).
"""

from __future__ import annotations

import sys
from typing import Any

from miles.errors import ConfigError
from miles.plugins import load_component

BACKEND = "diffusion"
LOSS = "diffusion_sft"


def _diffusion_loss_kind(name: str) -> str | None:
    """``policy`` / ``supervised`` for one of this package's objective losses, None for any other loss."""
    loss = load_component("loss", name)
    # A loss of this package imports miles_diffusion.losses when it loads; if that module is not
    # imported, the loss is someone else's (and a token recipe does not pay for importing diffusers).
    if "miles_diffusion.losses" not in sys.modules:
        return None
    from miles_diffusion.losses import ObjectiveLoss

    if not (isinstance(loss, type) and issubclass(loss, ObjectiveLoss)):
        return None
    return loss.kind


def check_supervised_recipe(config: Any) -> None:
    name = config.algorithm.loss or "sft"
    kind = _diffusion_loss_kind(name)
    if config.backend != BACKEND:
        if kind is not None:
            raise ConfigError(
                f"algorithm.loss {name!r} is a diffusion objective; it needs backend: {BACKEND} (a token "
                f"backend has nothing for it to score)"
            )
        return
    if kind != "supervised":
        raise ConfigError(
            f"backend {BACKEND!r} in mode: sft trains algorithm.loss: {LOSS} (flow matching on given images); "
            f"{name!r} is {'a rollout objective' if kind == 'policy' else 'a token loss'}"
        )
    refusals = [
        (config.lora is not None, "lora (LoRA is wired for the rollout path only)"),
        (config.placement.launcher != "local", "placement.launcher 'ray' (the backend is one local process)"),
        (
            int(getattr(getattr(config, "diffusion", None), "fsdp_ranks", 1)) > 1,
            "diffusion.fsdp_ranks above 1 (data-parallel SFT runs in the package driver only, trainer.fsdp_ranks)",
        ),
        (
            "max_length" in config.sft.model_fields_set,
            "sft.max_length (it truncates tokens; images have none)",
        ),
        (
            "micro_batch_size" in config.train.model_fields_set,
            "train.micro_batch_size (a step trains the batch)",
        ),
        (
            config.train.steps_per_rollout != 1,
            "train.steps_per_rollout (a step is one optimizer step per update)",
        ),
        (
            bool(config.train.warmup_steps) or config.train.lr_schedule != "constant",
            "train.warmup_steps / lr_schedule (the backend trains at a constant learning rate)",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"diffusion SFT (mode: sft, backend: {BACKEND}) cannot run {what}")
