"""Given images for diffusion SFT through the core loop (``mode: sft``): the sample kind ``image``.

``data.source: coloured_shapes`` hands out the procedural coloured-shape images of
:mod:`miles_diffusion.datasets` in the core's deterministic, resumable order (``data.shuffle``,
``data.seed``) and turns each into a core ``Sample`` whose ``payload`` is an :class:`ImagePayload`
(the image and its prompt id; the token fields stay empty): a
``miles.interfaces.SupervisedSampleSource`` of kind ``image``. The diffusion backend trains that
kind (its ``supervised_kinds``); the core refuses the source with a token backend, and a chat
dataset with the diffusion backend, before anything starts.

The source also holds the set's held-out images (:class:`HeldOutImages`), on which the backend
measures the flow-matching loss after every step (``sft/heldout_loss``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import Field

from miles.builtins.data.records import PromptPool
from miles.capabilities import ComponentOptions
from miles.errors import DataError
from miles.types import Prompt, Sample, Status
from miles_diffusion.datasets import ShapesDatasetConfig, build_shapes_dataset
from miles_diffusion.objectives import ImageBatch

IMAGE_SAMPLES = "image"
"""The sample kind of a given image with its prompt id (``SupervisedSampleSource.sample_kind``)."""

SETS = ("coloured_shapes",)
"""The image sets ``data.path`` may name (drawn procedurally: nothing is downloaded)."""


@dataclass(frozen=True)
class ImagePayload:
    """One given image in the model's range [-1, 1] ([C, H, W]) and the prompt id it is conditioned on."""

    image: torch.Tensor
    prompt: int


class ColouredShapesOptions(ComponentOptions):
    """``data.options`` of the ``coloured_shapes`` source: the set's size and how it is drawn."""

    num_images: int = Field(64, ge=1, description="training images (image i has prompt id i % num_prompts)")
    held_out: int = Field(16, ge=1, description="further images for the held-out loss only")
    image_seed: int = Field(
        0, ge=0, description="seed the images are drawn from (not their order: data.seed)"
    )
    image_size: int = Field(16, ge=4, description="pixels per side; must be the model's")
    num_prompts: int = Field(4, ge=1, le=4, description="prompt ids (colours); must be the model's")
    eval_seed: int = Field(1234, ge=0, description="noise of the held-out loss (the same draws every step)")


@runtime_checkable
class HeldOutImages(Protocol):
    """An image source with a held-out set: the backend's ``sft/heldout_loss`` is measured on it."""

    held_out: ImageBatch
    eval_seed: int


class ColouredShapesSource(PromptPool):
    """``data.source: coloured_shapes`` (``data.path: coloured_shapes``): see the module docstring."""

    Options = ColouredShapesOptions
    sample_kind = IMAGE_SAMPLES

    def __init__(
        self,
        path: str,
        shuffle: bool = True,
        seed: int = 0,
        options: dict[str, Any] | None = None,
        **_text_fields: Any,  # prompt_key, templates, chat template: nothing to format in an image
    ) -> None:
        if str(path).strip() not in SETS:
            raise DataError(
                f"data.path {path!r}: the coloured_shapes source draws the set {SETS[0]!r} (data.path: "
                f"{SETS[0]}); allowed: {', '.join(SETS)}"
            )
        o = ColouredShapesOptions(**(options or {}))
        # batch_size only bounds the package driver's draws; the core's sft.batch_size sets the step's.
        config = ShapesDatasetConfig(
            num_images=o.num_images, held_out=o.held_out, batch_size=1, seed=o.image_seed
        )
        data = build_shapes_dataset(config, o.image_size, o.num_prompts)
        self._images = data.train
        self.held_out = data.held_out
        self.eval_seed = o.eval_seed
        prompts = [
            Prompt(index=i, prompt=str(int(p)), label=None) for i, p in enumerate(data.train.prompts.tolist())
        ]
        super().__init__(prompts, shuffle=shuffle, seed=seed, name=f"image set {path!r}")

    def supervised_sample(self, prompt: Prompt) -> Sample:
        image = self._images.images[prompt.index]
        payload = ImagePayload(image=image, prompt=int(self._images.prompts[prompt.index]))
        return Sample(prompt=prompt, payload=payload, status=Status.COMPLETED)


def image_batch(samples: list[Sample], who: str) -> ImageBatch:
    """The samples' images as one batch, or one clear error naming ``who`` and what the sample holds."""
    images, prompts = [], []
    for sample in samples:
        payload = sample.payload
        if not isinstance(payload, ImagePayload):
            got = "no payload" if payload is None else f"a {type(payload).__name__} payload"
            raise TypeError(
                f"{who}: supervised sample {sample.prompt.index} carries {got}, not a given image; diffusion "
                "SFT trains on an image source (data.source: coloured_shapes)"
            )
        images.append(payload.image)
        prompts.append(payload.prompt)
    if not images:
        raise ValueError(f"{who}: no images")
    return ImageBatch(images=torch.stack(images), prompts=torch.tensor(prompts, dtype=torch.int64))
