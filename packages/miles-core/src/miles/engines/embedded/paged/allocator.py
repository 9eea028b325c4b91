"""Block allocator of the paged KV pool: a free list and one reference count per block.

The pool's token slots are grouped in fixed-size blocks; a sequence owns the list of
blocks its KV lives in (its *block table*). Blocks are reference-counted so that a
radix prefix cache can later share one block between several sequences: a block
returns to the free list only when its last holder lets go. Pure Python, no torch:
the scheduler calls it between forward passes.

Block 0 is reserved as a scratch block: padded rows of a captured CUDA graph write
their (ignored) KV there, so it is never handed out.
"""

from __future__ import annotations

import collections


class OutOfBlocks(Exception):
    """Raised when an allocation asks for more blocks than are free."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is scratch), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._refs[0] = 1  # the scratch block is held forever
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold for sequences (the scratch block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` token slots."""
        return -(-tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, each with one reference; all or nothing."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder of each block (a prefix shared with another sequence)."""
        for b in blocks:
            if self._refs[b] <= 0 or b == 0:
                raise ValueError(f"block {b} is not allocated; it cannot be shared")
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds goes back to the free list."""
        for b in blocks:
            if b == 0 or self._refs[b] <= 0:
                raise ValueError(f"block {b} released but not held (a double free)")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def check(self) -> None:
        """Raise if the accounting is broken: every block is free exactly once or held."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b in range(1, self.num_blocks):
            if (b in free) != (self._refs[b] == 0):
                raise AssertionError(f"block {b}: refcount {self._refs[b]}, on free list {b in free}")

    def reset(self) -> None:
        """Every block free again (the pool was released; nothing may hold blocks)."""
        self.__init__(self.num_blocks, self.block_size)  # type: ignore[misc]
