"""The package's image rewards as core rewards (``rollout.reward: brightness``, ...).

Each is a *group* reward (``group_reward = True``): the diffusion rollout hands it a group's samples
at once, and it scores their images in one batched call of the :class:`~miles_diffusion.rewards.ImageReward`.
``image_reward`` loads any image reward by this package's reward entry points or an import path
(``pkg.module:attr``): the plug-in point for a learned reward model.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from miles.capabilities import ComponentOptions, NoOptions
from miles.types import Sample
from miles_diffusion.payload import payload_of
from miles_diffusion.rewards import (
    Brightness,
    ImageReward,
    JpegCompressibility,
    JpegIncompressibility,
    TargetColour,
    load_reward,
)


class ImageGroupReward:
    """Scores the images of a group's samples (their trajectory payloads) with one image reward."""

    group_reward = True
    # An ImageReward maps each image to its own value, so any subset of a group may be scored on its
    # own: the pipelined rollout scores each microgroup as it arrives instead of waiting for the group.
    scores_independently = True

    def __init__(self, reward: ImageReward, name: str) -> None:
        self.reward = reward
        self.name = name

    def __call__(self, samples: list[Sample]) -> list[float]:
        payloads = [payload_of(s, f"reward {self.name!r}") for s in samples]
        images = torch.stack([p.image for p in payloads])
        prompts = torch.tensor([p.prompt for p in payloads], dtype=torch.int64)
        values = self.reward(images, prompts)
        return [float(v) for v in values]


class BrightnessReward(ImageGroupReward):
    """``brightness``: the mean pixel value in [0, 1]."""

    Options = NoOptions

    def __init__(self) -> None:
        super().__init__(Brightness(), "brightness")


class JpegOptions(ComponentOptions):
    quality: int = Field(95, ge=1, le=100, description="pillow's JPEG quality")


class JpegCompressibilityReward(ImageGroupReward):
    """``jpeg_compressibility``: minus the JPEG size in KiB (smoother images score higher)."""

    Options = JpegOptions

    def __init__(self, quality: int = 95) -> None:
        super().__init__(JpegCompressibility(quality), "jpeg_compressibility")


class JpegIncompressibilityReward(ImageGroupReward):
    """``jpeg_incompressibility``: the JPEG size in KiB (detailed images score higher)."""

    Options = JpegOptions

    def __init__(self, quality: int = 95) -> None:
        super().__init__(JpegIncompressibility(quality), "jpeg_incompressibility")


class TargetColourOptions(ComponentOptions):
    colours: list[list[float]] = Field(..., description="one RGB triple in [0, 1] per prompt id")


class TargetColourReward(ImageGroupReward):
    """``target_colour``: minus the mean squared distance of every pixel to the prompt's colour."""

    Options = TargetColourOptions

    def __init__(self, colours: list[list[float]]) -> None:
        super().__init__(TargetColour(colours), "target_colour")


class ByNameOptions(ComponentOptions):
    name: str = Field(
        ..., description="an image reward: this package's reward entry point or pkg.module:attr"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="its constructor's arguments")


class ImageRewardByName(ImageGroupReward):
    """``image_reward``: any :class:`~miles_diffusion.rewards.ImageReward`, loaded by name or import path."""

    Options = ByNameOptions

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(load_reward(name, options), name)
