"""Offline image sets for diffusion SFT, drawn procedurally (no downloads).

``coloured_shapes``: each image is one filled square or disc, of random size and position, on a
black background. Its prompt id picks the colour (``colours[prompt]``), so a model fitted to the set
has to follow its conditioning: the colour is the prompt, the shape and place are free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_diffusion.objectives import ImageBatch

PALETTE: tuple[tuple[float, float, float], ...] = (
    (0.9, 0.1, 0.1),
    (0.1, 0.8, 0.2),
    (0.15, 0.3, 0.95),
    (0.95, 0.85, 0.1),
)


@dataclass(frozen=True)
class ShapesDatasetConfig:
    num_images: int = 64
    """Training images, prompt ids in turn (image ``i`` has prompt ``i % num_prompts``)."""
    held_out: int = 16
    """Further images, drawn the same way, for the evaluation loss only."""
    batch_size: int = 16
    seed: int = 0
    colours: tuple[tuple[float, float, float], ...] = PALETTE
    """RGB in [0, 1], one per prompt id (at least as many as the model has prompts)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "colours", tuple(tuple(float(v) for v in c) for c in self.colours))
        if any(len(c) != 3 for c in self.colours):
            raise ValueError("colours must be RGB triples")
        if self.batch_size > self.num_images or self.num_images < 1 or self.held_out < 0:
            raise ValueError("need 1 <= batch_size <= num_images and held_out >= 0")


def coloured_shapes(
    count: int, image_size: int, colours: torch.Tensor, num_prompts: int, generator: torch.Generator
) -> ImageBatch:
    """``count`` images [count, 3, S, S] in the model's range [-1, 1] and their prompt ids."""
    if colours.shape[0] < num_prompts:
        raise ValueError(f"{colours.shape[0]} colours for {num_prompts} prompts")
    prompts = torch.arange(count) % num_prompts
    coords = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    centre = 0.25 + 0.5 * torch.rand(count, 2, generator=generator)
    radius = 0.15 + 0.2 * torch.rand(count, generator=generator)
    is_disc = torch.rand(count, generator=generator) < 0.5
    dy = yy[None] - centre[:, 0, None, None]
    dx = xx[None] - centre[:, 1, None, None]
    r = radius[:, None, None]
    disc = dx**2 + dy**2 <= r**2
    square = (dx.abs() <= r) & (dy.abs() <= r)
    mask = torch.where(is_disc[:, None, None], disc, square).float()  # [count, S, S]
    images = mask[:, None] * colours[prompts][:, :, None, None].float()
    return ImageBatch(images=images * 2.0 - 1.0, prompts=prompts)


@dataclass(frozen=True)
class ImageDataset:
    train: ImageBatch
    held_out: ImageBatch
    batch_size: int

    def batch(self, generator: torch.Generator) -> ImageBatch:
        """``batch_size`` training images drawn without replacement."""
        index = torch.randperm(self.train.images.shape[0], generator=generator)[: self.batch_size]
        return ImageBatch(self.train.images[index], self.train.prompts[index])


def build_shapes_dataset(config: ShapesDatasetConfig, image_size: int, num_prompts: int) -> ImageDataset:
    """The training and held-out sets, reproducible from ``config.seed``."""
    generator = torch.Generator().manual_seed(config.seed)
    colours = torch.tensor(config.colours, dtype=torch.float32)
    train = coloured_shapes(config.num_images, image_size, colours, num_prompts, generator)
    held = coloured_shapes(config.held_out, image_size, colours, num_prompts, generator)
    return ImageDataset(train, held, config.batch_size)


def class_mean_colours(images: torch.Tensor, prompts: torch.Tensor, num_prompts: int) -> torch.Tensor:
    """Mean RGB of the images of each prompt id, [num_prompts, 3] (``images`` in [0, 1])."""
    per_image = images.float().mean(dim=(2, 3))
    return torch.stack([per_image[prompts == k].mean(dim=0) for k in range(num_prompts)])
