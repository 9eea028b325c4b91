"""Classifier-free guidance (CFG): the velocity the sampler and the trainer step with.

With a guidance scale ``w`` the step's velocity is ``v_uncond + w * (v_cond - v_uncond)``, where
``v_uncond`` is the model's velocity under the unconditional encoding (for a text family: the empty
prompt's, the negative prompt diffusers uses by default; Qwen-Image's: the single space its
pipeline's examples guide against) and ``v_cond`` under the prompt's own. A family may combine the two
otherwise (``DiffusionModel.combine_guidance``): Qwen-Image rescales the guided velocity, token by
token, to the conditional one's norm, as its pipeline's "true CFG" does. Both
branches are one forward pass over a batch of ``2B`` (unconditional rows first, as diffusers orders
them), so guidance costs twice the denoiser's work per step. ``w = 1`` is no guidance: one forward
pass of the conditional branch alone, exactly the unguided velocity.

The sampler (the engine) and the trainer's re-scoring both take their velocity from
:func:`guided_velocity`, so a guided step's log-probability is computed the same way on both sides.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only (the decode workers import the sampler without diffusers)
    from miles_diffusion.denoiser import Conditioning, DiffusionModel

NO_GUIDANCE = 1.0


class GuidanceError(ValueError):
    """A guidance scale that cannot run: out of range, or for a model with no unconditional branch."""


def check_scale(scale: float, where: str = "guidance_scale") -> None:
    """``scale`` is a finite number >= 1 (1 is no guidance; below 1 would extrapolate away from the
    prompt, which no recipe here means)."""
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise GuidanceError(f"{where} must be a finite number >= 1.0, got {scale!r}")
    if scale < NO_GUIDANCE:
        raise GuidanceError(f"{where} must be >= 1.0 (1.0 is no guidance), got {scale}")


def check_unconditional(what: str, has_unconditional: bool, scale: float) -> None:
    """Refuse ``scale > 1`` for ``what`` (a model class or family name) without an unconditional
    branch: a null conditioning the model was trained with. The tiny UNet has none (its prompt table
    has no null row and it never trained with prompt dropout), and an arbitrary vector standing in
    for one would make the guided velocity meaningless, so it is refused rather than invented."""
    check_scale(scale)
    if scale != NO_GUIDANCE and not has_unconditional:
        raise GuidanceError(
            f"guidance_scale {scale}: {what} has no unconditional branch (no null prompt it was trained "
            "with), so classifier-free guidance cannot run on it; use guidance_scale 1.0 (the pipeline "
            "families guide against a negative prompt's encoding)"
        )


def check_model(model: DiffusionModel, scale: float) -> None:
    """Refuse ``scale > 1`` for a model without an unconditional branch, before any sampling."""
    check_unconditional(f"a {type(model).__name__}", model.has_unconditional, scale)


def guided_velocity(
    model: DiffusionModel,
    x_t: torch.Tensor,
    t: torch.Tensor,
    prompts: Conditioning,
    guidance_scale: float,
) -> torch.Tensor:
    """The velocity at ``x_t`` [B, ...], times ``t`` [B], under ``prompts`` (ids or encodings),
    guided with ``guidance_scale`` (1: the conditional velocity, one forward pass of B)."""
    if guidance_scale == NO_GUIDANCE:
        return model(x_t, t, prompts)
    both = model.with_unconditional(prompts)  # [unconditional rows; the prompts' rows], 2B
    v = model(torch.cat([x_t, x_t]), torch.cat([t, t]), both)
    v_uncond, v_cond = v.chunk(2)
    return model.combine_guidance(v_uncond, v_cond, guidance_scale)
