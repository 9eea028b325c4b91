"""The paged path's prefix cache: a radix tree of whole KV blocks, shared with running requests.

A request that leaves the scheduler (finished, aborted or retracted) hands the blocks
of its KV that are complete (``block_size`` tokens each) to this tree; a later request
whose tokens start with the same blocks' tokens takes those blocks into its own block
table (one more allocator reference each) and prefills only the rest. Nothing is
copied: the tree and the requests point at the same pool slots, and the allocator's
reference counts say who holds a block.

Why whole blocks
    A block is shared by reference, so it must never be written again: a request
    writes its KV from its ``kv_len`` on, and a full block lies entirely before it. A
    partial block would be written by the next token of whoever holds it. A block's
    KV depends on every token before it too (attention is causal), so a node is keyed
    by its own block's token ids under the node of the blocks before it: a path from
    the root spells a token prefix, one block per edge.

Adapters
    KV computed under a LoRA adapter is not the base's (nor another adapter's): each adapter
    has a tree of its own (``namespace``, the adapter's name; None is the base), so a lookup
    only ever finds blocks written under the same adapter. :meth:`RadixCache.flush_namespace`
    drops one adapter's tree (its factors were replaced or unloaded).

References
    The tree holds exactly one allocator reference on every block it contains. A
    block the tree already holds for the same tokens is not taken again when another
    request brings its own copy (that copy goes back to the free list when its request
    lets go). Weight versions are not part of the key: the engine flushes the tree on
    every weight change, and the scheduler does not insert a request whose KV was
    started before the last flush (:attr:`RadixCache.generation`).

Eviction
    Least recently used leaves first (a match or an insert uses every node of its
    path; a parent is never less recent than its children, so leaves are the right
    candidates). :meth:`RadixCache.evict` frees blocks for the pool: it drops only
    leaves that nobody but the tree holds, since dropping a block a running request
    holds frees nothing. The size bound (``max_tokens``) drops the tree's references
    regardless of other holders. The leaves are kept in a lazily cleaned heap keyed
    by last use, so an eviction costs a few heap operations, not a scan of the tree
    (under pool pressure one happens for every new block).

Pure Python, no torch, no thread-safety of its own: the scheduler uses it under
``step_lock`` between forward passes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

from miles.engines.embedded.paged.allocator import BlockAllocator


class _Node:
    __slots__ = ("block", "children", "key", "last_used", "parent")

    def __init__(self, key: tuple[int, ...], block: int, parent: _Node | None) -> None:
        self.key = key  # the token ids of this node's block
        self.block = block
        self.parent = parent  # None: the root, or a node removed from the tree
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0


class RadixCache:
    """Cached KV blocks keyed by the token prefix they hold; see the module doc.

    ``max_tokens`` (> 0) bounds the tokens the tree keeps, rounded down to whole blocks.
    """

    def __init__(self, allocator: BlockAllocator, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (leave the cache out to disable it), got {max_tokens}")
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_tokens = int(max_tokens)
        self.max_blocks = self.max_tokens // self.block_size
        #: Advances on every flush; KV started under an earlier generation is never inserted.
        self.generation = 0
        self.evictions = 0  # blocks dropped by the size bound or for the pool
        self.flushes = 0
        # One root per namespace (None: the base; else a LoRA adapter's name). Roots have block -1.
        self._roots: dict[str | None, _Node] = {}
        self._nodes: dict[int, _Node] = {}  # block id -> its node
        self._clock = 0
        # (last_used, tie-breaker, node) of leaves; entries go stale when a node is used again,
        # gains a child or leaves the tree, and are skipped when popped.
        self._heap: list[tuple[int, int, _Node]] = []
        self._order = itertools.count()

    # ------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return len(self._nodes)

    @property
    def num_tokens(self) -> int:
        return len(self._nodes) * self.block_size

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block: int) -> bool:
        return block in self._nodes

    def match(self, tokens: Sequence[int], limit: int, namespace: str | None = None) -> list[int]:
        """The blocks holding the longest cached prefix of ``tokens`` that fits in ``tokens[:limit]``,
        in order (whole blocks only), among those cached under ``namespace``. The caller takes its
        own references (``allocator.share``); the matched nodes count as used for eviction."""
        bs = self.block_size
        limit = min(limit, len(tokens))
        node = self._roots.get(namespace)
        if node is None:
            return []
        blocks: list[int] = []
        for start in range(0, limit - bs + 1, bs):
            child = node.children.get(tuple(tokens[start : start + bs]))
            if child is None:
                break
            blocks.append(child.block)
            node = child
        if blocks:
            self._use(node)
        return blocks

    # ------------------------------------------------------------- changes

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], namespace: str | None = None) -> int:
        """Keep ``blocks[i]`` as the KV of ``tokens[i * block_size : (i + 1) * block_size]`` after the
        blocks before it, under ``namespace``; returns how many blocks the tree took a reference on.

        The caller holds a reference on every block in ``blocks`` and keeps it (it releases its own
        afterwards). Blocks beyond the size bound are left out; least recently used leaves are then
        dropped down to the bound."""
        bs = self.block_size
        n = min(len(blocks), len(tokens) // bs, self.max_blocks)
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node((), -1, None)
        added = 0
        for i in range(n):
            key = tuple(tokens[i * bs : (i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                block = blocks[i]
                if block in self._nodes:
                    # The same block under another prefix would mean two different KVs in one place.
                    raise ValueError(f"block {block} is already cached for other tokens")
                self.allocator.share([block])
                child = _Node(key, block, node)
                node.children[key] = child
                self._nodes[block] = child
                added += 1
            node = child
        if n:
            self._use(node)
        if len(self._nodes) > self.max_blocks:
            self._drop_lru(len(self._nodes) - self.max_blocks, only_unshared=False)
        return added

    def evict(self, n: int) -> int:
        """Give up to ``n`` blocks back to the free list, least recently used first, dropping only
        blocks no running request holds; returns how many were freed."""
        if n <= 0:
            return 0
        return self._drop_lru(n, only_unshared=True)

    def flush(self) -> int:
        """Drop every block (requests holding some keep them) and advance :attr:`generation`;
        returns how many blocks the tree held."""
        dropped = len(self._nodes)
        blocks = list(self._nodes)
        for node in self._nodes.values():
            node.parent = None
            node.children = {}
        self._roots.clear()
        self._nodes.clear()
        self._heap.clear()
        self.allocator.release(blocks)
        self.generation += 1
        self.flushes += 1
        return dropped

    def flush_namespace(self, namespace: str | None) -> int:
        """Drop every block cached under ``namespace`` (requests holding some keep them) and advance
        :attr:`generation`; returns how many blocks it held."""
        root = self._roots.pop(namespace, None)
        blocks: list[int] = []
        stack = list(root.children.values()) if root is not None else []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            del self._nodes[node.block]
            node.parent = None  # its heap entries go stale
            node.children = {}
            blocks.append(node.block)
        self.allocator.release(blocks)
        self.generation += 1
        self.flushes += 1
        return len(blocks)

    def describe(self) -> dict[str, Any]:
        """Size and counters, for ``/get_server_info``."""
        return {
            "kind": "radix",
            "max_tokens": self.max_blocks * self.block_size,
            "block_size": self.block_size,
            "entries": len(self._nodes),  # one entry per cached block
            "adapter_trees": sum(1 for ns in self._roots if ns is not None),  # LoRA adapters with KV cached
            "tokens": self.num_tokens,
            "evictions": self.evictions,
            "flushes": self.flushes,
        }

    def check(self) -> None:
        """Raise if the tree is inconsistent with itself or with the allocator."""
        seen = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.parent is not node or child.key != key or len(key) != self.block_size:
                    raise AssertionError(f"block {child.block}: a broken edge")
                if self._nodes.get(child.block) is not child:
                    raise AssertionError(f"block {child.block}: not indexed")
                if self.allocator.refcount(child.block) < 1:
                    raise AssertionError(f"block {child.block} is cached but not allocated")
                if child.last_used > node.last_used and node.block >= 0:
                    raise AssertionError(f"block {child.block} is more recent than its parent")
                seen += 1
                stack.append(child)
        if seen != len(self._nodes):
            raise AssertionError(f"{len(self._nodes)} blocks indexed, {seen} in the tree")
        if len(self._nodes) > self.max_blocks:
            raise AssertionError(f"{len(self._nodes)} blocks cached, the bound is {self.max_blocks}")

    # ------------------------------------------------------------ internals

    def _use(self, node: _Node) -> None:
        """Mark ``node`` and its ancestors used now."""
        self._clock += 1
        walk: _Node | None = node
        while walk is not None and walk.block >= 0:  # up to its namespace's root
            walk.last_used = self._clock
            walk = walk.parent
        if not node.children:
            heapq.heappush(self._heap, (self._clock, next(self._order), node))
            if len(self._heap) > 2 * len(self._nodes) + 64:  # mostly stale entries: O(1) amortized
                self._rebuild_heap()

    def _drop_lru(self, n: int, *, only_unshared: bool) -> int:
        """Remove up to ``n`` leaves, least recently used first; ``only_unshared``: skip leaves whose
        block someone else holds too. Returns how many were removed."""
        removed = 0
        skipped: list[tuple[int, int, _Node]] = []
        heap = self._heap
        while removed < n and heap:
            entry = heapq.heappop(heap)
            used, _, node = entry
            if node.parent is None or node.children or node.last_used != used:
                continue  # stale: removed, no longer a leaf, or used again since
            if only_unshared and self.allocator.refcount(node.block) > 1:
                skipped.append(entry)
                continue
            parent = node.parent
            del parent.children[node.key]
            del self._nodes[node.block]
            node.parent = None
            self.allocator.release([node.block])
            removed += 1
            if parent.block >= 0 and not parent.children:  # (a root is never evicted)
                heapq.heappush(heap, (parent.last_used, next(self._order), parent))
        for entry in skipped:
            heapq.heappush(heap, entry)
        self.evictions += removed
        if len(heap) > 2 * len(self._nodes) + 64:
            self._rebuild_heap()
        return removed

    def _rebuild_heap(self) -> None:
        self._heap = [
            (node.last_used, next(self._order), node) for node in self._nodes.values() if not node.children
        ]
        heapq.heapify(self._heap)
