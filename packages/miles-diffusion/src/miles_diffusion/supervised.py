"""Diffusion SFT inside the diffusion backend (``mode: sft``, ``algorithm.loss: diffusion_sft``).

The core's supervised stage hands the backend batches of image samples (``miles_diffusion.image_data``:
each ``Sample.payload`` an :class:`~miles_diffusion.image_data.ImagePayload`); this module stacks them
and steps the objective (:class:`~miles_diffusion.objectives.SupervisedObjective`, flow matching), then
measures the flow-matching loss on the data source's held-out images at fixed noise levels and noise
(``sft/heldout_loss``: the same draws every step, so the values form a curve). The checks here run when
the backend is set up, before the first step: the images must have the model's shape and prompt ids.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.errors import ConfigError
from miles.plugins import make_component
from miles.types import Sample
from miles_diffusion.image_data import HeldOutImages, image_batch
from miles_diffusion.model import FlowModel
from miles_diffusion.objectives import ImageBatch, SupervisedObjective
from miles_diffusion.sft import evaluation_loss


class SupervisedTraining:
    """One backend's supervised objective, its model and the held-out images it is measured on."""

    def __init__(
        self, objective: SupervisedObjective, model: FlowModel, held_out: HeldOutImages, who: str
    ) -> None:
        check_images_fit(held_out.held_out, model, who)
        self.objective = objective
        self.model = model
        self.held_out = held_out
        self.who = who

    def train_step(self, samples: list[Sample], generator: torch.Generator) -> dict[str, float]:
        batch = image_batch(samples, self.who)
        check_images_fit(batch, self.model, self.who)
        stats = self.objective.train_on_batch(batch, generator)
        heldout = evaluation_loss(self.model, self.held_out.held_out, self.held_out.eval_seed)
        return {
            **{f"train/{key}": float(value) for key, value in stats.items()},
            "train/images": float(len(samples)),
            "sft/heldout_loss": heldout,
        }


def held_out_images(run: dict[str, Any], who: str) -> HeldOutImages:
    """The run's image source (``data:`` of the run config), rebuilt here for its held-out set."""
    data = dict(run.get("data") or {})
    source_name = data.pop("source", None)
    if source_name is None:
        raise ConfigError(f"{who}: diffusion SFT needs the run's data section (an image source)")
    source = make_component("data_source", source_name, data)
    if not isinstance(source, HeldOutImages):
        raise ConfigError(
            f"{who}: data.source {source_name!r} has no held-out images to measure the SFT loss on; diffusion "
            "SFT trains on an image source (data.source: coloured_shapes)"
        )
    return source


def check_images_fit(batch: ImageBatch, model: FlowModel, who: str) -> None:
    """The images have the model's channels and size, and their prompt ids are the model's."""
    c = model.config
    want = (c.channels, c.image_size, c.image_size)
    got = tuple(batch.images.shape[1:])
    if got != want:
        raise ConfigError(
            f"{who}: the data source's images are {got} (channels, height, width), the model takes {want}; "
            "set data.options.image_size to the model's"
        )
    if batch.prompts.numel() and int(batch.prompts.max()) >= c.num_prompts:
        raise ConfigError(
            f"{who}: the data source has prompt ids up to {int(batch.prompts.max())}, the model knows "
            f"{c.num_prompts} (0..{c.num_prompts - 1}); set data.options.num_prompts to the model's"
        )
