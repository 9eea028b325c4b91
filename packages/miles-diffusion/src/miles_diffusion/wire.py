"""How trajectories travel between the diffusion engine and the trainer: safetensors bytes.

A response is one safetensors buffer (raw little-endian tensor bytes behind a JSON header), never
base64 text and never a pickle: the receiver only parses a length, a JSON header and byte ranges.
String metadata rides in the header's ``__metadata__`` (the weight version, the sampler settings;
floats as ``float.hex`` so they come back exactly).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as _load_tensors
from safetensors.torch import save as _save_tensors

from miles_diffusion.sampler import SamplerConfig, Trajectory

MEDIA_TYPE = "application/vnd.miles.safetensors"
"""Content type of a packed response."""

_HEADER_LEN = struct.Struct("<Q")
_MAX_HEADER = 100 * 1024 * 1024


class WireError(ValueError):
    """Bytes that are not a packed trajectory batch (named in the message)."""


@dataclass(frozen=True)
class TrajectoryBatch:
    """What one ``/generate_trajectories`` call returns: the trajectories, their seeds, the sampler
    settings they were drawn with and the weight version that drew them."""

    trajectory: Trajectory
    seeds: list[int]
    sampler: SamplerConfig
    weight_version: int


def pack(batch: TrajectoryBatch) -> bytes:
    t = batch.trajectory
    tensors = {
        "latents": t.latents.contiguous(),
        "log_probs": t.log_probs.contiguous(),
        "timesteps": t.timesteps.contiguous(),
        "prompts": t.prompts.to(torch.int64).contiguous(),
        "seeds": torch.tensor(batch.seeds, dtype=torch.int64),
    }
    meta = {
        "weight_version": str(batch.weight_version),
        "num_steps": str(batch.sampler.num_steps),
        "noise_level": float(batch.sampler.noise_level).hex(),
    }
    return _save_tensors(tensors, metadata=meta)


def metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer (read from its header; no tensor is touched)."""
    if len(data) < _HEADER_LEN.size:
        raise WireError(f"{len(data)} bytes is too short for a safetensors buffer")
    (length,) = _HEADER_LEN.unpack_from(data)
    if length > min(_MAX_HEADER, len(data) - _HEADER_LEN.size):
        raise WireError(f"safetensors header of {length} bytes does not fit a {len(data)}-byte buffer")
    try:
        header = json.loads(data[_HEADER_LEN.size : _HEADER_LEN.size + length])
    except ValueError as exc:
        raise WireError(f"safetensors header is not JSON: {exc}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def unpack(data: bytes) -> TrajectoryBatch:
    meta = metadata(data)
    try:
        tensors = _load_tensors(data)
        sampler = SamplerConfig(int(meta["num_steps"]), float.fromhex(meta["noise_level"]))
        version = int(meta["weight_version"])
        trajectory = Trajectory(
            latents=tensors["latents"],
            timesteps=tensors["timesteps"],
            log_probs=tensors["log_probs"],
            prompts=tensors["prompts"],
        )
        seeds = [int(s) for s in tensors["seeds"].tolist()]
    except (KeyError, ValueError) as exc:
        raise WireError(f"not a packed trajectory batch: {type(exc).__name__}: {exc}") from None
    b = trajectory.latents.shape[0]
    if trajectory.log_probs.shape != (b, sampler.num_steps) or len(seeds) != b:
        raise WireError(
            f"packed trajectory batch is inconsistent: latents {tuple(trajectory.latents.shape)}, "
            f"log_probs {tuple(trajectory.log_probs.shape)}, {len(seeds)} seeds, {sampler.num_steps} steps"
        )
    return TrajectoryBatch(trajectory, seeds, sampler, version)
