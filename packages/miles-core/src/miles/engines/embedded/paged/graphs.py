"""CUDA graphs of the decode step, one per batch size of a ladder.

A graph replays the whole step: the forward pass over the paged pool (Triton
attention), the logits, and plain sampling (temperature and seed, no top-k/top-p).
Its inputs live in one static int64 buffer ``[5, max_batch]`` (token, position, slot,
table row and source of each query), refilled by one host-to-device copy per step; the rest
(block tables, temperatures, seeds) is read from the runner's device tables inside the
graph. A query's token is either given (``source`` -1) or, when the host has not read the
previous step yet (overlapped decoding), the previous step's sampled token at index
``source`` of the runner's ``last_tokens`` buffer, picked inside the graph. A batch runs on the smallest captured size that holds it; the padded rows feed
token 0 at position 0 into the scratch slot, with table row 0 (scratch), and their
outputs are ignored. Batches with top-k/top-p rows use the graph's logits and sample
eagerly afterwards.

LoRA (``paged/lora.py``): while adapters are loaded the graphs are captured with the
adapter hooks on, each row's slot read from the runner's ``lora_rows`` table by its table
row inside the graph (padded rows: row 0, slot 0, no adapter). Adapter factors live in
preallocated stacks updated in place, so loading an adapter into a free slot or updating
its weights needs no recapture; the runner captures again only when stacks are allocated
or freed (``PagedRunner.lora_layout_changed``).

Graphs hold the pool's addresses: releasing the pool drops them, and the next
decode after a resume captures them again. Weight updates copy into the parameters
in place, so they need no recapture.

For an MoE model the graphs also write every row's routed experts into one static
buffer ``[sparse layers, max_batch, top_k]``; after a replay the model's ``routed``
points at its first rows, copied to the host only when a request asked for its routing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from miles.engines.embedded.paged.model import PagedMeta, StepInputs
from miles.engines.embedded.paged.sampling import row_keys

if TYPE_CHECKING:
    from miles.engines.embedded.paged.runner import PagedRunner

log = logging.getLogger("miles.engines.embedded")


def batch_ladder(max_batch: int) -> list[int]:
    """Captured batch sizes: fine steps where a padded row costs most (small batches), coarse above."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    sizes += list(range(96, max_batch + 32, 32))
    out = sorted({min(s, max_batch) for s in sizes})
    return out


class DecodeGraphs:
    def __init__(self, runner: PagedRunner, max_batch: int) -> None:
        self.runner = runner
        self.sizes = batch_ladder(max_batch)
        self.buffer = torch.zeros(5, self.sizes[-1], dtype=torch.long, device=runner.device)
        model = runner.model
        self.routed = (
            torch.zeros(model.num_sparse, self.sizes[-1], model.top_k, dtype=torch.long, device=runner.device)
            if model.num_sparse
            else None
        )
        self._graphs: dict[int, tuple[Any, tuple[Any, Any, Any]]] = {}
        self._pool: Any = None

    def fits(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def _body(self, bs: int) -> tuple[Any, Any, Any]:
        from miles.engines.embedded.paged.triton_kernels import sample_plain

        r = self.runner
        given, pos, slots, rows, source = (self.buffer[i, :bs] for i in range(5))
        ids = torch.where(source >= 0, r.last_tokens[source.clamp(min=0)], given)
        meta = PagedMeta(r.block_tables, rows.to(torch.int32), (pos + 1).to(torch.int32))
        routed = self.routed[:, :bs] if self.routed is not None else None
        lora: Any = contextlib.nullcontext()
        if r.lora is not None and r.lora.stacks:
            lora = r.lora.tokens(r.lora_rows[rows])
        with lora:
            logits = r.model.forward(StepInputs(ids, pos, slots, None, meta, routed))
        tokens, logprobs = sample_plain(logits, r.temps[rows], row_keys(r.seeds[rows], pos + 1))
        return logits, tokens, logprobs

    def capture(self) -> None:
        """Capture every size, largest first (later, smaller graphs reuse its memory pool)."""
        t0 = time.monotonic()
        self.buffer.zero_()
        self.buffer[4].fill_(-1)
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        for bs in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._body(bs)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._body(bs)
            self._graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.runner.device)
        log.info(
            "captured %d decode CUDA graphs (batch %s) in %.1fs",
            len(self.sizes),
            self.sizes,
            time.monotonic() - t0,
        )

    def drop(self) -> None:
        self._graphs.clear()
        self._pool = None

    def replay(self, packed: list[list[int]]) -> tuple[Any, Any, Any]:
        """Run the step of ``packed`` (five lists: tokens, positions, slots, rows, sources; see the
        module docstring); returns the logits, tokens and log-probs of its rows."""
        if not self._graphs:
            self.capture()
        n = len(packed[0])
        bs = next(s for s in self.sizes if s >= n)
        host = torch.zeros(5, bs, dtype=torch.long)
        host[4] = -1  # padded rows: token 0, given
        host[:, :n] = torch.tensor(packed, dtype=torch.long)
        self.buffer[:, :bs].copy_(host)
        graph, (logits, tokens, logprobs) = self._graphs[bs]
        graph.replay()
        if self.routed is not None:
            self.runner.model.routed = self.routed[:, :n]
        return logits[:n], tokens[:n], logprobs[:n]
