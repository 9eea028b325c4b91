"""Tiny flow-matching image models built from config with random weights (no downloads).

The model predicts the rectified-flow velocity ``v = noise - image`` for a noisy image
``x_t = (1 - t) * image + t * noise`` at time ``t`` in ``[0, 1]`` (``t = 1`` is pure noise). It
is a diffusers ``UNet2DModel`` whose class-embedding table stands in for a text encoder: a prompt is
an integer id, and every image of one prompt shares one embedding row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from diffusers import UNet2DModel
from torch import nn

from miles_diffusion.precision import PrecisionConfig, keep_fp32

# UNet2DModel expects timesteps on the scale diffusion schedulers use (0..1000).
TIMESTEP_SCALE = 1000.0


@dataclass(frozen=True)
class TinyFlowModelConfig:
    """Shape of the tiny model: pixel space, ``channels`` x ``image_size`` x ``image_size``."""

    image_size: int = 16
    channels: int = 3
    num_prompts: int = 4
    block_out_channels: tuple[int, ...] = (16, 32)
    layers_per_block: int = 1
    norm_num_groups: int = 8


class FlowModel(nn.Module):
    """Velocity predictor ``v(x_t, t, prompt)`` over a diffusers UNet with a prompt-embedding table."""

    def __init__(self, config: TinyFlowModelConfig, precision: PrecisionConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.precision = precision or PrecisionConfig()
        depth = len(config.block_out_channels)
        # cast: diffusers' ModelMixin is not seen as an nn.Module by mypy.
        self.unet = cast(
            nn.Module,
            UNet2DModel(
                sample_size=config.image_size,
                in_channels=config.channels,
                out_channels=config.channels,
                block_out_channels=config.block_out_channels,
                layers_per_block=config.layers_per_block,
                down_block_types=("DownBlock2D",) * depth,
                up_block_types=("UpBlock2D",) * depth,
                norm_num_groups=config.norm_num_groups,
                num_class_embeds=config.num_prompts,
            ),
        )
        self.fp32_modules = keep_fp32(self, self.precision.fp32_modules)
        """Modules computed in FP32 while the rest runs at ``precision.compute_dtype``."""

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        """``x_t``: [B, C, H, W]; ``t``: [B] in [0, 1]; ``prompts``: [B] int ids. Returns v, [B, C, H, W].

        Under a BF16/FP16 ``precision`` the UNet runs under autocast (FP32 parameters, the named FP32
        modules outside it) and v comes back as FP32."""
        if self.precision.dtype is torch.float32:
            out = self.unet(x_t, t * TIMESTEP_SCALE, class_labels=prompts, return_dict=False)[0]
        else:
            with torch.autocast(device_type=x_t.device.type, dtype=self.precision.dtype):
                out = self.unet(x_t, t * TIMESTEP_SCALE, class_labels=prompts, return_dict=False)[0]
            out = out.float()
        assert isinstance(out, torch.Tensor)
        return out


def build_tiny_model(
    config: TinyFlowModelConfig, seed: int, precision: PrecisionConfig | None = None
) -> FlowModel:
    """Random weights, reproducible from ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FlowModel(config, precision)


def forward_noise(images: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward (noising) process ``x_t = (1 - t) * images + t * noise``; ``t``: [B] in [0, 1]."""
    tb = t.to(images.dtype).view(-1, *([1] * (images.ndim - 1)))
    return (1.0 - tb) * images + tb * noise


def velocity_target(images: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow velocity ``d x_t / d t = noise - images`` the model is trained to predict."""
    return noise - images


def flow_matching_error(
    model: FlowModel, images: torch.Tensor, prompts: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """Per-sample mean squared error of the model's velocity at ``x_t`` against the target, [B]."""
    v = model(forward_noise(images, noise, t), t, prompts)
    return ((v - velocity_target(images, noise)) ** 2).flatten(1).mean(dim=1)
