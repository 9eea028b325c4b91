"""What the sampler, the trainer and the objectives drive: a velocity model over a latent space.

Every model family (:mod:`miles_diffusion.families`) loads into a :class:`DiffusionModel`: the
tiny pixel-space UNet (:class:`miles_diffusion.model.FlowModel`, whose "latents" are the pixels)
Stable Diffusion 3 (:class:`miles_diffusion.sd3.SD3FlowModel`, VAE latents and text
encoders) and Wan text-to-video (:class:`miles_diffusion.wan.WanFlowModel`, video latents with a
frame axis). A prompt is always an integer id; what the id means (an embedding row, a text of the
recipe's ``prompts`` list) is the family's business, behind :meth:`DiffusionModel.encode_prompts`.

Only what trains is registered as a submodule: ``parameters()`` and ``state_dict()`` are the
trainable denoiser's (the optimizer's parameters, the weight updates, the checkpoints), and
:meth:`DiffusionModel.frozen_modules` lists the rest (text encoders, VAE), frozen and in eval mode.

This module imports torch only (the wire format's decode workers import the sampler, which names
these types, without diffusers).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import Protocol

import torch
from torch import nn


class PromptEncodings(Protocol):
    """A batch of prompt encodings other than one tensor (e.g. SD3's sequence + pooled embeddings):
    rows are selected with an index tensor or a slice, as a tensor's are."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: torch.Tensor | slice) -> PromptEncodings: ...


Conditioning = torch.Tensor | PromptEncodings
"""What the denoiser reads for a prompt: its id ([B] int64), or encodings from ``encode_prompts``."""


def linear_schedule(num_steps: int) -> torch.Tensor:
    """``num_steps + 1`` evenly spaced times from 1 (noise) to 0 (image)."""
    return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)


class DiffusionModel(nn.Module, metaclass=ABCMeta):
    """Velocity ``v(x_t, t, prompt)`` of rectified flow, ``x_t = (1 - t) x_0 + t noise``.

    Subclasses implement ``forward(x_t [B, *latent_shape], t [B] in [0, 1], prompts) -> v`` (the
    prompts as ids or as :meth:`encode_prompts` output) and the abstract members below (a family
    that misses one cannot be instantiated)."""

    latents_are_pixels: bool = False
    """Whether :meth:`to_images` is a fixed map of the latents any client can apply (pixel space) or
    needs the model's own decoder (a VAE): an engine then sends the decoded images beside them."""

    @property
    @abstractmethod
    def num_prompts(self) -> int:
        """Prompt ids run over ``0 .. num_prompts - 1``."""
        ...

    @property
    @abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """(channels, height, width) of one latent (the space the sampler works in); a video family's
        has a frame axis, (channels, frames, height, width)."""
        ...

    @abstractmethod
    def encode_prompts(self, prompts: torch.Tensor) -> Conditioning:
        """The conditioning the denoiser reads for ``prompts`` ([B] int ids); computed once per
        request by an engine and handed to ``forward`` in place of the ids at every step."""
        ...

    @abstractmethod
    def to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents [B, *latent_shape] to images [B, 3, H, W] in [0, 1] (what rewards score:
        one image per trajectory; a video family lays its frames side by side)."""
        ...

    def timestep_schedule(self, num_steps: int) -> torch.Tensor:
        """The ``num_steps + 1`` times the sampler visits, from 1 to 0 (default: evenly spaced). A
        family may start below 1 (Cosmos); the sampler then scales its initial noise by the first time."""
        return linear_schedule(num_steps)

    def frozen_modules(self) -> dict[str, nn.Module]:
        """Modules the model uses but never trains (not in ``parameters()``): none by default."""
        return {}

    has_unconditional: bool = False
    """Whether the family has an unconditional branch for classifier-free guidance
    (:mod:`miles_diffusion.guidance`): a null conditioning the model was trained with. A family
    without one refuses a guidance scale above 1."""

    def with_unconditional(self, prompts: Conditioning) -> Conditioning:
        """The conditioning of a guided batch of ``2B``: the unconditional encoding for the first B
        rows, then ``prompts``' own encodings (ids are encoded first). Only for a family with
        :attr:`has_unconditional`."""
        raise ValueError(f"a {type(self).__name__} has no unconditional branch for classifier-free guidance")

    def combine_guidance(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided velocity from the two branches' velocities at guidance ``scale``: classifier-free
        guidance's ``v_uncond + scale (v_cond - v_uncond)``. A family whose pipeline guides by another
        formula (Qwen-Image's norm-rescaled "true CFG") overrides it; the sampler and the trainer both
        call it through :func:`miles_diffusion.guidance.guided_velocity`."""
        return v_uncond + scale * (v_cond - v_uncond)
