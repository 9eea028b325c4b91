"""The record a diffusion rollout attaches to each core ``Sample`` (``Sample.payload``).

The core's samples are token-oriented; an image trajectory has no tokens. The rollout leaves the
token fields empty and puts everything the reward and the backend need here: the whole denoising
trajectory of one sample, the log-probability of every step under the engine's weights, and what
drew it (prompt id, seed, sampler settings, weight version). The core carries it and never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.types import Sample
from miles_diffusion.sampler import SamplerConfig, Trajectory


@dataclass(frozen=True)
class TrajectoryPayload:
    """One sample's trajectory: ``latents`` [S + 1, C, H, W] (noise first, image last; a video
    family's [S + 1, C, F, h, w]), ``log_probs``
    [S], ``timesteps`` [S + 1] from 1 to 0."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    prompt: int
    seed: int
    sampler: SamplerConfig
    weight_version: int
    decoded: torch.Tensor | None = None
    """[C, H, W] in [0, 1]: the engine's decoding of the final latents, for a model whose latents are
    not pixels (SD3, Wan: the VAE runs in the engine; a Wan video's frames side by side, [3, H,
    frames * W]); None for a pixel-space model."""

    @property
    def image(self) -> torch.Tensor:
        """The generated image in [0, 1], [C, H, W]."""
        if self.decoded is not None:
            return self.decoded
        return ((self.latents[-1] + 1.0) / 2.0).clamp(0.0, 1.0)


def payload_of(sample: Sample, who: str) -> TrajectoryPayload:
    """The sample's trajectory, or one clear error naming ``who`` needed it and what produced the sample."""
    payload = sample.payload
    if not isinstance(payload, TrajectoryPayload):
        got = "no payload" if payload is None else f"a {type(payload).__name__} payload"
        raise TypeError(
            f"{who}: sample {sample.group_index} of prompt {sample.prompt.index} carries {got}, not a "
            "diffusion trajectory; it needs the diffusion rollout (rollout.fn: diffusion) and engines "
            "(engine.launcher: diffusion)"
        )
    return payload


def split(
    trajectory: Trajectory,
    seeds: list[int],
    sampler: SamplerConfig,
    version: int,
    images: torch.Tensor | None = None,
) -> list[TrajectoryPayload]:
    """One payload per trajectory of a batch (``images``: the engine's decoded images, if it sent any)."""
    return [
        TrajectoryPayload(
            latents=trajectory.latents[i],
            log_probs=trajectory.log_probs[i],
            timesteps=trajectory.timesteps,
            prompt=int(trajectory.prompts[i]),
            seed=int(seeds[i]),
            sampler=sampler,
            weight_version=version,
            decoded=None if images is None else images[i],
        )
        for i in range(trajectory.latents.shape[0])
    ]


def stack(payloads: list[TrajectoryPayload], who: str) -> Trajectory:
    """The payloads as one batched trajectory; they must share the sampler settings and timesteps."""
    if not payloads:
        raise ValueError(f"{who}: no trajectories")
    first = payloads[0]
    for p in payloads[1:]:
        if p.sampler != first.sampler or not torch.equal(p.timesteps, first.timesteps):
            raise ValueError(
                f"{who}: trajectories drawn with different sampler settings ({first.sampler} and {p.sampler}) "
                "cannot be trained in one batch"
            )
    return Trajectory(
        latents=torch.stack([p.latents for p in payloads]),
        timesteps=first.timesteps,
        log_probs=torch.stack([p.log_probs for p in payloads]),
        prompts=torch.tensor([p.prompt for p in payloads], dtype=torch.int64),
    )
