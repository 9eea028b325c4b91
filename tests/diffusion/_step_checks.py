"""Recorders the diffusion tests share: a diffusers pipeline's first denoising step, and the whole
gradients a trainer's first optimizer update takes (gathered from FSDP2 shards)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

PipelineCallback = Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]]


def first_step_recorder(seen: dict[str, torch.Tensor]) -> PipelineCallback:
    """A ``callback_on_step_end`` that keeps the latents after the pipeline's first step in
    ``seen["latents"]`` and stops the pipeline there (with ``callback_on_step_end_tensor_inputs=["latents"]``)."""

    def first_step(pipeline: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if i == 0:
            seen["latents"] = kwargs["latents"].clone()
        pipeline._interrupt = True  # one step is enough
        return kwargs

    return first_step


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``, whole (a DTensor's shards gathered)."""
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def record_first_update(trainer: Any, grads: dict[str, torch.Tensor]) -> None:
    """Keep in ``grads`` the gradients ``trainer``'s first optimizer update takes (after clipping), whole."""
    step = trainer.optimizer.step

    def recording(*args: Any, **kwargs: Any) -> Any:
        if not grads:
            grads.update({n: full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording
