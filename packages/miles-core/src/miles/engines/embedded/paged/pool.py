"""The KV pool: one key and one value tensor per layer, indexed by token slot.

Layout ``[num_slots, kv_heads, head_dim]`` per layer (slot = block * block_size +
offset), stacked over layers in one tensor for keys and one for values, so a
release frees two allocations and a resume makes the same two again.

Sizing: on CUDA, ``mem_fraction`` of the memory free after the model was loaded
(what ``torch.cuda.mem_get_info`` reports, so other processes' use counts); on the
CPU, ``kv_tokens`` token slots. Either way the result is rounded down to whole
blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("miles.engines.embedded")


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def bytes(self, element_size: int) -> int:
        """Bytes of keys plus values."""
        return 2 * self.num_layers * self.num_slots * self.kv_heads * self.head_dim * element_size


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    return 2 * num_layers * kv_heads * head_dim * element_size


def plan_blocks(
    *,
    device: Any,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    element_size: int,
    block_size: int,
    mem_fraction: float,
    kv_tokens: int,
) -> int:
    """Number of blocks of the pool: from free GPU memory on CUDA, from ``kv_tokens`` elsewhere.

    ``kv_tokens > 0`` wins on CUDA too (a fixed budget, e.g. for tests)."""
    import torch

    per_block = bytes_per_token(num_layers, kv_heads, head_dim, element_size) * block_size
    if kv_tokens > 0:
        blocks = kv_tokens // block_size + 1  # + the scratch block
    elif device.type == "cuda":
        if not 0.0 < mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must lie in (0, 1), got {mem_fraction}")
        free, _total = torch.cuda.mem_get_info(device)
        blocks = int(free * mem_fraction) // per_block
    else:
        raise ValueError("on the CPU the KV pool is sized by kv_tokens (> 0); mem_fraction is for CUDA")
    if blocks < 2:
        raise ValueError(
            f"the KV pool would hold {blocks} blocks of {block_size} tokens ({per_block} bytes each); "
            "raise mem_fraction / kv_tokens"
        )
    return blocks


class KVPool:
    """The key and value tensors; :meth:`release` frees them, :meth:`resume` makes them again."""

    def __init__(self, shape: PoolShape, dtype: Any, device: Any) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.k: Any = None
        self.v: Any = None
        self.resume()

    @property
    def allocated(self) -> bool:
        return self.k is not None

    def resume(self) -> None:
        import torch

        if self.k is not None:
            return
        s = self.shape
        dims = (s.num_layers, s.num_slots, s.kv_heads, s.head_dim)
        # Zeros, not empty: scratch and unwritten slots are read (then masked) by padded rows,
        # and NaN garbage times a zero weight would still poison a softmax row.
        self.k = torch.zeros(dims, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(dims, dtype=self.dtype, device=self.device)

    def addresses(self) -> tuple[int, int] | None:
        """Where the K and V tensors live (None: released); captured graphs depend on them."""
        return None if self.k is None else (self.k.data_ptr(), self.v.data_ptr())

    def release(self) -> int:
        """Free both tensors; returns the bytes they held."""
        if self.k is None:
            return 0
        held = self.nbytes
        self.k = self.v = None
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        return held

    @property
    def nbytes(self) -> int:
        return self.shape.bytes(self.k.element_size()) if self.k is not None else 0
