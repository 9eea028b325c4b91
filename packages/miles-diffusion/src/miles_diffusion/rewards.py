"""Image rewards that run offline, and the plug-in point for learned reward models.

A reward is anything matching :class:`ImageReward`: it scores a batch of images in [0, 1]
([B, C, H, W], float) together with their prompt ids and returns one float per image. A learned
reward model (an aesthetic scorer, a VLM judge) implements the same call; the recipe names it by
entry point (``miles_diffusion.rewards``) or by import path ``pkg.module:attr``.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from PIL import Image

ENTRY_POINT_GROUP = "miles_diffusion.rewards"


@runtime_checkable
class ImageReward(Protocol):
    def __call__(self, images: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        """``images``: [B, C, H, W] in [0, 1]; ``prompts``: [B] ids. Returns [B] float32 rewards."""
        ...


def _to_uint8_hwc(image: torch.Tensor) -> np.ndarray:
    array = (image.detach().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    return array.permute(1, 2, 0).cpu().numpy()


def jpeg_size_kib(image: torch.Tensor, quality: int = 95) -> float:
    """Size in KiB of one [C, H, W] image saved as a JPEG by pillow."""
    buffer = io.BytesIO()
    Image.fromarray(_to_uint8_hwc(image)).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1024.0


class JpegCompressibility:
    """Minus the JPEG size in KiB: smoother, simpler images score higher."""

    sign = -1.0

    def __init__(self, quality: int = 95) -> None:
        self.quality = quality

    def __call__(self, images: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        sizes = [jpeg_size_kib(image, self.quality) for image in images]
        return self.sign * torch.tensor(sizes, dtype=torch.float32)


class JpegIncompressibility(JpegCompressibility):
    """The JPEG size in KiB: detailed, high-frequency images score higher."""

    sign = 1.0


class TargetColour:
    """Minus the mean squared distance of every pixel to the prompt's target RGB colour (in [0, 1]).

    Each prompt id names a colour (``colours[prompt]``), so the reward also checks that the model
    follows its conditioning: the best image for prompt 0 is not the best for prompt 1.
    """

    def __init__(self, colours: Sequence[Sequence[float]]) -> None:
        table = torch.tensor([list(c) for c in colours], dtype=torch.float32)
        if table.ndim != 2 or table.shape[1] != 3:
            raise ValueError(f"colours must be a list of RGB triples, got shape {tuple(table.shape)}")
        self.colours = table

    def __call__(self, images: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        target = self.colours[prompts.long()][:, :, None, None]
        return -((images.float() - target) ** 2).mean(dim=(1, 2, 3))


class Brightness:
    """Mean pixel value in [0, 1]."""

    def __call__(self, images: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        return images.float().mean(dim=(1, 2, 3))


def load_reward(name: str, options: Mapping[str, Any] | None = None) -> ImageReward:
    """Build a reward from an entry-point name or a ``pkg.module:attr`` import path."""
    if ":" in name:
        module_name, attr = name.split(":", 1)
        factory = getattr(importlib.import_module(module_name), attr)
    else:
        matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not matches:
            known = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
            raise ValueError(f"unknown image reward {name!r}; known: {known}")
        factory = matches[0].load()
    reward = factory(**dict(options or {}))
    if not isinstance(reward, ImageReward):
        raise TypeError(f"{name!r} did not build a callable image reward")
    return reward
