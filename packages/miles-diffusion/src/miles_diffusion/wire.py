"""How trajectories travel between the diffusion engine and the trainer: safetensors bytes.

A response is one safetensors buffer (raw little-endian tensor bytes behind a JSON header), never
base64 text and never a pickle: the receiver only parses a length, a JSON header and byte ranges.
String metadata rides in the header's ``__metadata__`` (the weight version, the sampler settings;
floats as ``float.hex`` so they come back exactly).

A **streamed** response (``stream: true``, the pipelined rollout) is a sequence of frames, one per
microgroup, each an 8-byte little-endian length and then one such buffer, whose metadata also
says which microgroup it is (``microgroup``, ``microgroups``, ``offset``) and when the engine
sampled it (``started_ns``, ``finished_ns``: ``time.monotonic_ns``, one clock for every process of
a host). A failure after the answer began is a frame carrying only ``error``. The client copies
each frame as it arrives into one shared-memory buffer (:class:`FrameReader`); a decode worker
process parses and checks it and hands back tensors that are views of that same buffer
(:func:`unpack_frame`), so a frame's bytes are copied once, from the socket into memory both
processes map.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as _load_tensors
from safetensors.torch import save as _save_tensors

from miles.engines.embedded.weights import SAFETENSORS_DTYPES
from miles_diffusion.guidance import NO_GUIDANCE
from miles_diffusion.sampler import SamplerConfig, Trajectory

MEDIA_TYPE = "application/vnd.miles.safetensors"
"""Content type of a packed response."""

STREAM_MEDIA_TYPE = "application/vnd.miles.safetensors-stream"
"""Content type of a streamed response: length-prefixed packed frames, one per microgroup."""

_HEADER_LEN = struct.Struct("<Q")
_FRAME_LEN = struct.Struct("<Q")
_MAX_HEADER = 100 * 1024 * 1024
MAX_FRAME_BYTES = 1 << 40
"""Largest frame a reader accepts (a corrupt length must not become a terabyte allocation)."""

# The safetensors dtype names this format may carry: the engine's own table.
_DTYPES = SAFETENSORS_DTYPES
_TENSORS = ("latents", "log_probs", "timesteps", "prompts", "seeds")


class WireError(ValueError):
    """Bytes that are not a packed trajectory batch (named in the message)."""


class EngineStreamError(RuntimeError):
    """The engine failed after its streamed answer began; the message is the engine's."""


@dataclass(frozen=True)
class TrajectoryBatch:
    """What one ``/generate_trajectories`` call returns: the trajectories, their seeds, the sampler
    settings they were drawn with and the weight version that drew them."""

    trajectory: Trajectory
    seeds: list[int]
    sampler: SamplerConfig
    weight_version: int
    images: torch.Tensor | None = None
    """[B, 3, H, W] in [0, 1]: the final latents decoded by the model's own decoder (a VAE; a video
    model's frames side by side, W = frames * width), sent by an engine whose latents are not pixels (the client has no decoder); None for pixel-space models."""


@dataclass(frozen=True)
class Microgroup:
    """One frame of a streamed answer: trajectories ``offset .. offset + len(batch.seeds)`` of the
    request, microgroup ``index`` of ``count``, sampled by the engine between ``started_ns`` and
    ``finished_ns`` (``time.monotonic_ns``), unpacked by process ``worker_pid``."""

    index: int
    count: int
    offset: int
    batch: TrajectoryBatch
    started_ns: int
    finished_ns: int
    worker_pid: int


def pack(batch: TrajectoryBatch, extra: Mapping[str, str] | None = None) -> bytes:
    """One safetensors buffer; ``extra`` adds string metadata (a frame's microgroup fields)."""
    t = batch.trajectory
    tensors = {
        "latents": t.latents.contiguous(),
        "log_probs": t.log_probs.contiguous(),
        "timesteps": t.timesteps.contiguous(),
        "prompts": t.prompts.to(torch.int64).contiguous(),
        "seeds": torch.tensor(batch.seeds, dtype=torch.int64),
    }
    if batch.images is not None:
        tensors["images"] = batch.images.contiguous()
    meta = {
        "weight_version": str(batch.weight_version),
        "num_steps": str(batch.sampler.num_steps),
        "noise_level": float(batch.sampler.noise_level).hex(),
        "guidance_scale": float(batch.sampler.guidance_scale).hex(),
        **(extra or {}),
    }
    return _save_tensors(tensors, metadata=meta)


def pack_microgroup(
    batch: TrajectoryBatch, *, index: int, count: int, offset: int, started_ns: int, finished_ns: int
) -> bytes:
    """One frame's buffer (without its length prefix: see :func:`frame_prefix`)."""
    extra = {
        "microgroup": str(index),
        "microgroups": str(count),
        "offset": str(offset),
        "started_ns": str(started_ns),
        "finished_ns": str(finished_ns),
    }
    return pack(batch, extra)


def pack_error(message: str) -> bytes:
    """A frame's buffer that says the engine failed (no tensors, ``error`` in the metadata)."""
    return _save_tensors({}, metadata={"error": message})


def frame_prefix(data: bytes) -> bytes:
    """The 8-byte length that goes before ``data`` in a stream."""
    return _FRAME_LEN.pack(len(data))


def metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer (read from its header; no tensor is touched)."""
    return _header(data, len(data))[1]


def _header(head: bytes, total: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """(the tensor entries, the metadata, where the tensor bytes start) of a ``total``-byte
    safetensors buffer whose first bytes, its header included, are ``head``."""
    if total < _HEADER_LEN.size:
        raise WireError(f"{total} bytes is too short for a safetensors buffer")
    (length,) = _HEADER_LEN.unpack_from(head)
    if length > min(_MAX_HEADER, total - _HEADER_LEN.size):
        raise WireError(f"safetensors header of {length} bytes does not fit a {total}-byte buffer")
    try:
        header = json.loads(head[_HEADER_LEN.size : _HEADER_LEN.size + length])
    except ValueError as exc:
        raise WireError(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None)
    return header, (dict(meta) if isinstance(meta, dict) else {}), _HEADER_LEN.size + length


def _batch(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> TrajectoryBatch:
    try:
        sampler = SamplerConfig(
            int(meta["num_steps"]),
            float.fromhex(meta["noise_level"]),
            # absent from an engine that predates guidance: it sampled unguided
            float.fromhex(meta.get("guidance_scale", float(NO_GUIDANCE).hex())),
        )
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
    images = tensors.get("images")
    if images is not None and (images.ndim != 4 or images.shape[0] != b or not images.is_floating_point()):
        raise WireError(
            f"packed trajectory batch is inconsistent: images {images.dtype} {tuple(images.shape)} for {b} "
            "trajectories (expected [B, C, H, W] floats)"
        )
    return TrajectoryBatch(trajectory, seeds, sampler, version, images)


def unpack(data: bytes) -> TrajectoryBatch:
    """A packed (unstreamed) answer; the tensors are copies owned by the caller."""
    meta = metadata(data)
    try:
        tensors = _load_tensors(data)
    except Exception as exc:  # safetensors raises its own error type for malformed buffers
        raise WireError(f"not a packed trajectory batch: {type(exc).__name__}: {exc}") from None
    return _batch(tensors, meta)


# ------------------------------------------------------------------------ streams


class FrameReader:
    """Cuts a stream's bytes into frames as they arrive: ``feed(chunk)`` returns the frames it
    completed, each a uint8 tensor holding one packed buffer (in shared memory with ``shared``,
    so a decode worker maps the same pages instead of being sent a copy)."""

    def __init__(self, *, shared: bool = True, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.shared = shared
        self.max_frame_bytes = max_frame_bytes
        self.frames = 0
        """Frames completed so far."""
        self._prefix = bytearray()
        self._frame: torch.Tensor | None = None
        self._array: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._filled = 0

    def _start(self, length: int) -> None:
        if not _HEADER_LEN.size <= length <= self.max_frame_bytes:
            raise WireError(
                f"frame {self.frames}: length {length} is outside 8..{self.max_frame_bytes} bytes (a corrupt stream)"
            )
        frame = torch.empty(length, dtype=torch.uint8)
        if self.shared:
            frame.share_memory_()
        self._frame, self._array, self._filled = frame, frame.numpy(), 0

    def feed(self, chunk: bytes) -> list[torch.Tensor]:
        done: list[torch.Tensor] = []
        view = memoryview(chunk).cast("B")
        i = 0
        while i < len(view):
            if self._frame is None:
                take = view[i : i + _FRAME_LEN.size - len(self._prefix)]
                self._prefix += take
                i += len(take)
                if len(self._prefix) < _FRAME_LEN.size:
                    break
                (length,) = _FRAME_LEN.unpack(self._prefix)
                self._prefix.clear()
                self._start(length)
            assert self._frame is not None and self._array is not None
            k = min(len(view) - i, self._frame.numel() - self._filled)
            self._array[self._filled : self._filled + k] = np.frombuffer(view[i : i + k], dtype=np.uint8)
            self._filled += k
            i += k
            if self._filled == self._frame.numel():
                done.append(self._frame)
                self._frame, self._array = None, None
                self.frames += 1
        return done

    def finish(self) -> None:
        """The stream ended: refuse a frame cut short."""
        if self._frame is not None:
            raise WireError(
                f"the stream ended inside frame {self.frames} ({self._filled} of {self._frame.numel()} bytes)"
            )
        if self._prefix:
            raise WireError(f"the stream ended inside the length of frame {self.frames}")


def _views(frame: torch.Tensor, entries: Mapping[str, Any], start: int) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors buffer held in ``frame`` (uint8), as views of it (no copy)."""
    size = frame.numel() - start
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"tensor {name!r}: malformed header entry {entry!r} ({exc})") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = int(np.prod(shape)) if shape else 1
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= size or end - begin != count * itemsize:
            raise WireError(
                f"tensor {name!r}: {entry['dtype']} {shape} at bytes {begin}..{end} does not fit a "
                f"{size}-byte data section"
            )
        raw = frame[start + begin : start + end]
        if (start + begin) % itemsize:  # safetensors aligns its data; copy rather than fail if not
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(shape)
    return tensors


def unpack_frame(frame: torch.Tensor) -> Microgroup:
    """A frame's microgroup, its tensors views of ``frame`` (a uint8 tensor from :class:`FrameReader`).

    Runs in a decode worker (``miles_diffusion.decode``): pure parsing and checking, the tensors
    go back as views of the shared buffer. An ``error`` frame raises :class:`EngineStreamError`,
    bytes that are not a frame :class:`WireError`."""
    if frame.dtype != torch.uint8 or frame.ndim != 1:
        raise WireError(f"a frame is a 1-D uint8 tensor, got {frame.dtype} {tuple(frame.shape)}")
    # Only the header is copied out (to parse its JSON); the tensors stay where they are.
    head = frame[: _HEADER_LEN.size].numpy().tobytes()
    if len(head) == _HEADER_LEN.size:
        (length,) = _HEADER_LEN.unpack(head)
        head += frame[_HEADER_LEN.size : _HEADER_LEN.size + min(length, _MAX_HEADER)].numpy().tobytes()
    entries, meta, start = _header(head, frame.numel())
    if "error" in meta:
        raise EngineStreamError(meta["error"])
    missing = [name for name in _TENSORS if name not in entries]
    if missing:
        raise WireError(f"not a packed trajectory batch: tensors {missing} are missing")
    batch = _batch(_views(frame, entries, start), meta)
    try:
        index, count, offset = int(meta["microgroup"]), int(meta["microgroups"]), int(meta["offset"])
        started, finished = int(meta["started_ns"]), int(meta["finished_ns"])
    except (KeyError, ValueError) as exc:
        raise WireError(f"not a microgroup frame: {type(exc).__name__}: {exc}") from None
    if not 0 <= index < count or offset < 0:
        raise WireError(f"not a microgroup frame: microgroup {index} of {count} at offset {offset}")
    return Microgroup(index, count, offset, batch, started, finished, os.getpid())
