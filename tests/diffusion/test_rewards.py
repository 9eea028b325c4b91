from __future__ import annotations

import pytest
import torch

from miles_diffusion.rewards import (
    Brightness,
    ImageReward,
    JpegCompressibility,
    JpegIncompressibility,
    TargetColour,
    load_reward,
)


def _flat_and_noisy() -> torch.Tensor:
    flat = torch.full((3, 32, 32), 0.5)
    noisy = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))
    return torch.stack([flat, noisy])


def test_jpeg_compressibility_prefers_flat_images_and_incompressibility_noise() -> None:
    images, prompts = _flat_and_noisy(), torch.zeros(2, dtype=torch.long)
    comp = JpegCompressibility()(images, prompts)
    incomp = JpegIncompressibility()(images, prompts)
    assert comp[0] > comp[1] and incomp[1] > incomp[0]
    assert torch.equal(comp, -incomp)


def test_target_colour_is_best_at_the_prompts_colour() -> None:
    reward = TargetColour([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    blue = torch.zeros(3, 8, 8)
    blue[2] = 1.0
    images = torch.stack([red, blue, red, blue])
    scores = reward(images, torch.tensor([0, 0, 1, 1]))
    assert scores[0] == 0.0 and scores[3] == 0.0
    assert scores[1] < 0.0 and scores[2] < 0.0


def test_brightness() -> None:
    images = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)])
    assert Brightness()(images, torch.zeros(2)).tolist() == [0.0, 1.0]


def test_rewards_load_by_entry_point_and_import_path() -> None:
    assert isinstance(load_reward("jpeg_compressibility"), JpegCompressibility)
    colour = load_reward("target_colour", {"colours": [[0.1, 0.2, 0.3]]})
    assert isinstance(colour, TargetColour) and isinstance(colour, ImageReward)
    assert isinstance(load_reward("miles_diffusion.rewards:Brightness"), Brightness)
    with pytest.raises(ValueError, match="unknown image reward"):
        load_reward("no_such_reward")
