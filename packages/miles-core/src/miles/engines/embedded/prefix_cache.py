"""The prefix cache: the KV of finished requests, kept so that a later request that starts
with the same tokens (a session's next turn) prefills only what is new.

A multi-turn session sends turn ``k + 1`` as ``prompt_k + output_k + new_suffix``, to the
same engine (session-affinity routing). When turn ``k`` finishes (stop or length; never
an aborted or failed request), the scheduler stores the KV of every token the model
consumed, ``prompt_k + output_k[:-1]`` (the last sampled token was never fed), as one
entry. Turn ``k + 1`` looks up its prompt, feeds only the tokens after the cached prefix,
and its own entry then replaces turn ``k``'s, so a live session holds one entry.

Entries
    ``tokens`` (the consumed token ids), ``kv`` (per layer ``(key, value)``, each
    ``[1, kv_heads, n, head_dim]`` on the engine's device, padding removed, RoPE already
    applied at positions ``0 .. n-1``) and, for MoE requests that recorded it, ``routed``
    (int32 ``[n, num_layers, topk]`` on the CPU: the experts every consumed token was
    routed to). Entries are never written after they are stored; a prefill that reuses
    one copies its tensors into the new batch's cache.

Lookups
    A lookup returns the entry sharing the *longest common prefix* with the request's
    tokens, capped by the caller (at least one token must stay to be fed, since the
    prefill has to produce the logits of the last one). Any prefix of an entry is valid
    KV on its own (attention is causal), so a retried or branched turn that diverges
    inside an entry still reuses the part before the divergence.

    Entries are indexed by their first :data:`MIN_TOKENS` tokens. A prompt's candidates
    are the entries of its own first block; a prompt unrelated to every stored entry
    costs one dict probe. Sessions that share a system prompt share a block, so the
    candidates are then scanned: each costs one C-speed list-slice comparison (plus a
    binary search by slices where the entry diverges), and their number is bounded by
    ``max_tokens / MIN_TOKENS``, in practice by the number of live sessions. Prefixes
    shorter than :data:`MIN_TOKENS` are neither stored nor reused: their prefill is cheap.

Bounds and invalidation
    The cache holds at most ``max_tokens`` tokens over all entries; the least recently
    stored or reused entries are evicted first. (Device memory per token is
    ``2 x num_layers x kv_heads x head_dim x dtype size``: 56 KiB for a 7B Qwen in
    bfloat16, so the default 65536 tokens take about 3.5 GiB.) :meth:`PrefixCache.flush`
    drops every entry and advances :attr:`PrefixCache.generation`; the engine flushes on
    every weight change and on ``/flush_cache``. A request whose KV was started under an
    older generation is not stored when it finishes (part of its KV may come from
    weights that are gone).

Thread-safety: none of its own. It is used only under the scheduler's ``step_lock``
(lookups and stores happen inside scheduler steps, flushes take the lock), which
already serializes every change to the model, its weights and the running batch.
:meth:`PrefixCache.describe` alone is read without it (a snapshot of counters).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: Token ids every entry is indexed by (its first block); shorter prefixes are never cached.
MIN_TOKENS = 16

#: Per layer ``(key, value)``, each ``[1, kv_heads, n, head_dim]``.
KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class PrefixEntry:
    """The KV (and, when recorded, the routing) of ``tokens``; immutable once stored."""

    tokens: list[int]
    kv: KVLayers
    routed: torch.Tensor | None  # int32 [len(tokens), num_layers, topk], or None when not recorded
    nbytes: int


@dataclass(frozen=True)
class PrefixHit:
    """A lookup's answer: the first ``length`` tokens of ``entry`` equal the request's first ``length``."""

    entry: PrefixEntry
    length: int

    def kv(self) -> KVLayers:
        """Views of the entry's KV over the reused tokens (do not write into them)."""
        n = self.length
        return [(k[..., :n, :], v[..., :n, :]) for k, v in self.entry.kv]

    def routed(self) -> torch.Tensor | None:
        """The routing of the reused tokens, ``[length, num_layers, topk]``, or None when not recorded."""
        return None if self.entry.routed is None else self.entry.routed[: self.length]


def common_prefix_length(a: Sequence[int], b: Sequence[int], limit: int, known: int = 0) -> int:
    """The largest ``n <= limit`` with ``a[:n] == b[:n]``, given that ``a[:known] == b[:known]``.

    Slice comparisons run at C speed; a mismatch is located by binary search, so the
    cost is a few passes over at most ``limit`` elements.
    """
    limit = min(limit, len(a), len(b))
    if known >= limit or a[known:limit] == b[known:limit]:
        return limit
    lo, hi = known, limit  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """A bounded, LRU-evicted set of :class:`PrefixEntry`, looked up by longest common prefix.

    ``max_tokens`` bounds the total tokens of all entries (must be > 0; an engine without
    a prefix cache has no ``PrefixCache``). Not thread-safe: see the module doc.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (leave the cache out to disable it), got {max_tokens}")
        self.max_tokens = int(max_tokens)
        #: Advances on every flush; KV started under an earlier generation is never stored.
        self.generation = 0
        self.num_tokens = 0
        self.nbytes = 0
        self.evictions = 0
        self.flushes = 0
        # Least recently stored or reused first; the values are unused (an ordered set).
        self._lru: collections.OrderedDict[PrefixEntry, None] = collections.OrderedDict()
        self._index: dict[tuple[int, ...], list[PrefixEntry]] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(
        self, tokens: Sequence[int], max_length: int, *, need_routing: bool = False
    ) -> PrefixHit | None:
        """The longest stored prefix of ``tokens``, at most ``max_length`` long, or None.

        ``need_routing``: only entries that carry routing qualify (the request returns
        the routed experts of the positions it would take from the cache). A hit counts
        as a use for LRU eviction.
        """
        if max_length < MIN_TOKENS or len(tokens) < MIN_TOKENS:
            return None
        bucket = self._index.get(tuple(tokens[:MIN_TOKENS]))
        if not bucket:
            return None
        best: PrefixEntry | None = None
        best_length = 0
        for entry in bucket:
            if need_routing and entry.routed is None:
                continue
            n = common_prefix_length(entry.tokens, tokens, max_length, known=MIN_TOKENS)
            if n > best_length:
                best, best_length = entry, n
        if best is None:
            return None
        self._lru.move_to_end(best)
        return PrefixHit(best, best_length)

    def insert(self, tokens: list[int], kv: KVLayers, routed: torch.Tensor | None = None) -> bool:
        """Store the KV of ``tokens`` (see :class:`PrefixEntry` for the layout); True when stored.

        Entries whose tokens are a prefix of ``tokens`` are dropped (the new one covers
        them: one entry per live session). Nothing is stored when an entry already covers
        ``tokens``, or when ``tokens`` is shorter than :data:`MIN_TOKENS` or longer than the
        whole budget. Least recently used entries are then evicted down to the budget.
        """
        n = len(tokens)
        if routed is not None and routed.shape[0] != n:
            raise ValueError(f"routing covers {routed.shape[0]} tokens, the entry has {n}")
        if n < MIN_TOKENS or n > self.max_tokens:
            return False
        key = tuple(tokens[:MIN_TOKENS])
        for old in list(self._index.get(key, ())):
            m = len(old.tokens)
            # An entry with routing is worth more than one without: never replace it by a poorer one.
            if m >= n and old.tokens[:n] == tokens and (old.routed is not None or routed is None):
                self._lru.move_to_end(old)
                return False
            if m <= n and tokens[:m] == old.tokens and (routed is not None or old.routed is None):
                self._remove(old)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv) + (routed.nbytes if routed is not None else 0)
        entry = PrefixEntry(tokens=list(tokens), kv=kv, routed=routed, nbytes=nbytes)
        self._index.setdefault(key, []).append(entry)
        self._lru[entry] = None
        self.num_tokens += n
        self.nbytes += nbytes
        while self.num_tokens > self.max_tokens:
            self._remove(next(iter(self._lru)))
            self.evictions += 1
        return True

    def flush(self) -> int:
        """Drop every entry and advance :attr:`generation`; returns how many entries were dropped."""
        dropped = len(self._lru)
        self._lru.clear()
        self._index.clear()
        self.num_tokens = self.nbytes = 0
        self.generation += 1
        self.flushes += 1
        return dropped

    def describe(self) -> dict[str, Any]:
        """Size and counters, for ``/get_server_info``."""
        return {
            "max_tokens": self.max_tokens,
            "entries": len(self._lru),
            "tokens": self.num_tokens,
            "bytes": self.nbytes,
            "evictions": self.evictions,
            "flushes": self.flushes,
        }

    def _remove(self, entry: PrefixEntry) -> None:
        del self._lru[entry]
        key = tuple(entry.tokens[:MIN_TOKENS])
        bucket = self._index[key]
        bucket.remove(entry)
        if not bucket:
            del self._index[key]
        self.num_tokens -= len(entry.tokens)
        self.nbytes -= entry.nbytes
