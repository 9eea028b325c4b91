"""The digest of a tensor's bytes: one function shared by trainers and engines, so digests compare.

``tensor_digest(t)`` is the xxh3_128 digest (32 lowercase hex characters) of the
tensor's raw bytes: its elements in C-contiguous (row-major) order, each in the
machine's native byte order (little-endian on every platform Miles runs on). No
value is ever converted: a bfloat16 tensor is hashed as its 2-byte patterns, so
two tensors have the same digest iff they are bit-for-bit equal (``-0.0`` and
``0.0`` differ; NaNs with equal bits are equal). The digest covers the bytes only;
compare dtype and shape separately (the engine's ``/weights_checker`` checksum
reports all three).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DIGEST_ALGORITHM = "xxh3_128"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (copied to the CPU and made contiguous only when needed)."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # Viewing as uint8 reinterprets the bytes (any dtype, including bfloat16 and bool).
    return flat.view(torch.uint8).numpy().data


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3_128 hex digest of ``t``'s raw bytes (see the module docstring for the exact definition)."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(tensor_bytes(t))
