"""The paged runner: pool, allocator, per-request device state, prefill chunks and decode steps.

Each running request holds one row of the device-side request tables (its block
table row, temperature, top-p, top-k, seed, LoRA adapter slot); row 0 is scratch, used
by the padded rows of a CUDA graph (slot 0: no adapter). A decode step uploads one
small int64 tensor (token, position, slot, table row and source of each query) and
reads back one (sampled ids and log-probs): nothing else crosses between host and
device per step.

Decode steps are *launched* and *read* separately (``launch_decode`` returns a
``PendingSamples``): the host can launch step N+1 before it reads step N, feeding each
request the token step N sampled for it straight from the device (``last_tokens``),
so the host's bookkeeping of step N runs while the device computes step N+1. The
read-back goes to pinned host memory behind a CUDA event, so only the read waits.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from miles.engines.embedded.paged.allocator import BlockAllocator
from miles.engines.embedded.paged.graphs import DecodeGraphs
from miles.engines.embedded.paged.model import GatherMeta, PagedMeta, PagedModel, StepInputs, gather_meta
from miles.engines.embedded.paged.pool import KVPool, PoolShape, plan_blocks
from miles.engines.embedded.paged.sampling import SamplingTensors, sample

if TYPE_CHECKING:
    from miles.engines.embedded.paged.lora import PagedLoraServing

log = logging.getLogger("miles.engines.embedded")


@dataclass
class PagedOptions:
    block_size: int = 16
    mem_fraction: float = 0.3  # of the GPU memory free after the model is loaded
    kv_tokens: int = 0  # > 0: a pool of this many token slots (required on the CPU)
    chunk_tokens: int = 8192  # most prefill tokens one step feeds (chunked prefill)
    cuda_graphs: bool = True
    max_batch_size: int = 64
    overlap: bool = True  # launch decode step N+1 before reading step N (see the module docstring)


@dataclass(eq=False)
class SeqState:
    """A request's place in the pool (kept across a retract; blocks and row are then given back)."""

    seed: int
    blocks: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens whose key and value are in the pool
    row: int = -1  # device table row; -1 when not running
    filtered: bool = False  # top-k or top-p: sampled after the graph, by the sorting path
    routed: bool = False  # the request asked for the experts its tokens are routed to (MoE)
    lora_slot: int = 0  # its LoRA adapter's slot (0: the base), set by the scheduler before attach


# The routed experts of tokens a state fed in one step: (state, position of the first token,
# int32 [tokens, sparse layers, top_k] on the CPU).
RoutedTokens = tuple[SeqState, int, torch.Tensor]


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    routed: list[RoutedTokens] = field(default_factory=list)  # for the states that asked (MoE)


class RoutedCopy:
    """The routed experts of some tokens of a step, on their way to the host.

    Started right after the step's forward, before its read-back, without blocking the host
    (pinned memory behind a CUDA event): it adds no synchronisation, and a later step writing
    the same graph buffer runs after it on the stream. ``entries()`` waits for it."""

    def __init__(
        self, routed: torch.Tensor, index: list[int] | None, owners: list[tuple[SeqState, int, int, int]]
    ) -> None:
        self.owners = owners  # (state, first position, first copied row, count)
        picked = routed if index is None else routed[:, torch.tensor(index, device=routed.device)]
        rows = picked.to(torch.int32).permute(1, 0, 2).contiguous()  # [tokens, sparse layers, top_k]
        self._event: Any = None
        if rows.is_cuda:
            self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self._host.copy_(rows, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = rows

    def entries(self) -> list[RoutedTokens]:
        if self._event is not None:
            self._event.synchronize()
        return [(st, first, self._host[at : at + n].clone()) for st, first, at, n in self.owners]


class PendingSamples:
    """A step's sampled tokens and log-probs on their way to the host; ``read()`` waits for them."""

    def __init__(self, tokens: Any, logprobs: Any, staging: Any | None) -> None:
        n = int(tokens.shape[0])
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])
        self._event: Any = None
        if staging is None:  # read at once (the CPU, where the step has already run, or a prefill)
            self._host = both
        else:  # copied to pinned memory without blocking the host; the event marks its end
            self._host = staging[:, :n]
            self._host.copy_(both, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._read: Sampled | None = None
        self.routed: RoutedCopy | None = None  # set by the runner when a state asked for its routing

    def read(self) -> Sampled:
        if self._read is None:
            if self._event is not None:
                self._event.synchronize()
            both = self._host.tolist()
            routed = self.routed.entries() if self.routed is not None else []
            self._read = Sampled([int(t) for t in both[0]], both[1], routed)
        return self._read


class PagedRunner:
    def __init__(self, model: Any, device: torch.device, options: PagedOptions, max_context: int) -> None:
        config = model.config
        num_layers = int(config.num_hidden_layers)
        kv_heads = int(config.num_key_value_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        dtype = model.get_input_embeddings().weight.dtype
        self.device = device
        self.options = options
        blocks = plan_blocks(
            device=device,
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            element_size=torch.tensor([], dtype=dtype).element_size(),
            block_size=options.block_size,
            mem_fraction=options.mem_fraction,
            kv_tokens=options.kv_tokens,
        )
        self.allocator = BlockAllocator(blocks, options.block_size)
        self.pool = KVPool(
            PoolShape(num_layers, kv_heads, head_dim, options.block_size, blocks), dtype, device
        )
        self.max_context = min(max_context, self.allocator.capacity_tokens)
        self.model = PagedModel(model, self.pool, options.block_size, self.max_context + 1)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        rows = options.max_batch_size + 1
        self.max_blocks = self.allocator.blocks_for(self.max_context + 1)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)
        self.temps = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_k = torch.full((rows,), self.vocab_size, dtype=torch.int64, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        # The LoRA adapter slot of each table row (0: none); read inside the decode graphs.
        self.lora_rows = torch.zeros(rows, dtype=torch.int64, device=device)
        self.lora: PagedLoraServing | None = None  # set by the engine
        self._free_rows = list(range(rows - 1, 0, -1))
        # The tokens the last decode step sampled, in its query order: the next step's inputs when
        # the host launches it before reading this one.
        self.last_tokens = torch.zeros(rows, dtype=torch.long, device=device)
        # Two pinned read-back buffers, alternated: step N is read while step N+1 copies into the other.
        self._staging = (
            [torch.empty(2, rows, dtype=torch.float64, pin_memory=True) for _ in range(2)]
            if device.type == "cuda"
            else None
        )
        self._launches = 0
        self._writes: list[tuple[int, int, int]] = []  # pending (row, column, block) table writes
        self.graphs: DecodeGraphs | None = None
        self._released_at: tuple[int, int] | None = None  # the pool's addresses when it was released
        if device.type == "cuda" and options.cuda_graphs and self.model.graph_reason is not None:
            log.info("CUDA graphs off: %s", self.model.graph_reason)
        elif device.type == "cuda" and options.cuda_graphs:
            self.graphs = DecodeGraphs(self, options.max_batch_size)
        log.info(
            "paged KV pool: %d blocks of %d tokens (%d tokens, %.2f GiB); chunked prefill %d tokens; "
            "CUDA graphs %s",
            blocks,
            options.block_size,
            self.allocator.capacity_tokens,
            self.pool.nbytes / 2**30,
            options.chunk_tokens,
            "on" if self.graphs is not None else "off",
        )

    # ------------------------------------------------------------ request rows

    def attach(self, state: SeqState, temperature: float, top_p: float, top_k: int) -> None:
        """Give a request a device table row (on admission)."""
        if state.row >= 0:
            return
        state.row = self._free_rows.pop()
        k = top_k if 0 < top_k < self.vocab_size else self.vocab_size
        state.filtered = k < self.vocab_size or top_p < 1.0
        values = torch.tensor([temperature, top_p], dtype=torch.float32)
        self.temps[state.row] = values[0]
        self.top_p[state.row] = values[1]
        self.top_k[state.row] = k
        self.seeds[state.row] = state.seed
        self.lora_rows[state.row] = state.lora_slot
        for j, b in enumerate(state.blocks):
            self._writes.append((state.row, j, b))

    def detach(self, state: SeqState) -> None:
        """Give back the request's blocks and row (finished, aborted or retracted)."""
        if state.blocks:
            self.allocator.release(state.blocks)
        state.blocks = []
        state.kv_len = 0
        if state.row >= 0:
            self._free_rows.append(state.row)
            state.row = -1

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def grow(self, state: SeqState, tokens: int) -> bool:
        """Make room for ``tokens`` token slots in total; False when the pool has too few free blocks."""
        need = self.allocator.blocks_for(tokens) - len(state.blocks)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        new = self.allocator.allocate(need)
        first = len(state.blocks)
        state.blocks.extend(new)
        if state.row >= 0:
            self._writes.extend((state.row, first + j, b) for j, b in enumerate(new))
        return True

    def _flush_writes(self) -> None:
        if not self._writes:
            return
        w = torch.tensor(self._writes, dtype=torch.int64).to(self.device)
        self.block_tables[w[:, 0], w[:, 1]] = w[:, 2].to(torch.int32)
        self._writes.clear()

    def _slot(self, state: SeqState, pos: int) -> int:
        bs = self.options.block_size
        return state.blocks[pos // bs] * bs + pos % bs

    # ----------------------------------------------------------------- steps

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[SeqState, list[int], bool]]) -> Sampled:
        """Feed each ``(state, tokens, sample)`` chunk after the state's ``kv_len`` tokens (their
        blocks already allocated); sample the next token of the chunks marked so."""
        self._flush_writes()
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampled: list[SeqState] = []
        for state, tokens, want in chunks:
            start = state.kv_len
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [self._slot(state, p) for p in range(start, start + len(tokens))]
            if want:
                logit_rows.append(len(ids) - 1)
                sampled.append(state)
        meta = gather_meta(
            [len(t) for _, t, _ in chunks],
            [s.kv_len + len(t) for s, t, _ in chunks],
            [s.blocks for s, _, _ in chunks],
            self.options.block_size,
            self.device,
        )
        dev = self.device
        step = StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slots=torch.tensor(slots, dtype=torch.long, device=dev),
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
            attn=meta,
        )
        scope: Any = contextlib.nullcontext()
        if self.lora is not None and any(st.lora_slot for st, _, _ in chunks):
            token_slots = [st.lora_slot for st, tokens, _ in chunks for _ in tokens]
            scope = self.lora.tokens(torch.tensor(token_slots, dtype=torch.long, device=dev), step.logit_rows)
        with scope:
            logits = self.model.forward(step) if logit_rows or ids else None
        routed = self._copy_prefill_routing(chunks)
        for state, tokens, _ in chunks:
            state.kv_len += len(tokens)
        if not sampled:
            return Sampled([], [], routed.entries() if routed is not None else [])
        assert logits is not None
        rows = torch.tensor([s.row for s in sampled], dtype=torch.long, device=dev)
        pos = torch.tensor([s.kv_len for s in sampled], dtype=torch.long, device=dev)
        out = self._sample(logits, rows, pos)
        if routed is not None:
            out.routed = routed.entries()
        return out

    def _copy_prefill_routing(self, chunks: list[tuple[SeqState, list[int], bool]]) -> RoutedCopy | None:
        """Start copying the routed experts of the chunks whose state asked (before ``kv_len``
        advances past them); None when none did or the model has no sparse layer."""
        if not self.model.num_sparse:
            return None
        index: list[int] = []
        owners: list[tuple[SeqState, int, int, int]] = []
        flat = 0
        for state, tokens, _ in chunks:
            if state.routed:
                owners.append((state, state.kv_len, len(index), len(tokens)))
                index.extend(range(flat, flat + len(tokens)))
            flat += len(tokens)
        if not owners:
            return None
        return RoutedCopy(self.model.routed, None if len(index) == flat else index, owners)

    def _copy_decode_routing(self, states: list[SeqState], positions: list[int]) -> RoutedCopy | None:
        """The same for a decode step: the whole (small) buffer is copied, no index is uploaded."""
        if not self.model.num_sparse:
            return None
        owners = [(s, p, i, 1) for i, (s, p) in enumerate(zip(states, positions, strict=True)) if s.routed]
        return RoutedCopy(self.model.routed, None, owners) if owners else None

    def _sampling(self, rows: Any, positions: Any) -> SamplingTensors:
        top_k, top_p = self.top_k[rows], self.top_p[rows]
        return SamplingTensors(
            temperature=self.temps[rows],
            top_p=top_p,
            top_k=top_k,
            seeds=self.seeds[rows],
            positions=positions,
            filtered=False,
        )

    def _sample(self, logits: Any, rows: Any, positions: Any, filtered: bool | None = None) -> Sampled:
        """Sample and read back at once (prefill: its caller needs the tokens before going on)."""
        return PendingSamples(*self._sample_device(logits, rows, positions, filtered), staging=None).read()

    def _sample_device(
        self, logits: Any, rows: Any, positions: Any, filtered: bool | None = None
    ) -> tuple[Any, Any]:
        """Sampled tokens and their log-probs, left on the device."""
        st = self._sampling(rows, positions)
        if filtered is None:
            filtered = bool(((st.top_k < self.vocab_size) | (st.top_p < 1.0)).any())
        st.filtered = filtered
        return sample(logits, st)

    @torch.inference_mode()
    def launch_decode(
        self, states: list[SeqState], tokens: list[int], sources: list[int], filtered: bool
    ) -> PendingSamples:
        """Launch the decode step of ``states`` without waiting for it.

        Query ``i`` feeds ``tokens[i]``, or, where ``sources[i] >= 0``, the token the previous
        launch sampled for its query ``sources[i]`` (not read by the host yet). Each state's slot
        at ``kv_len`` must be allocated; ``kv_len`` advances now."""
        self._flush_writes()
        n = len(states)
        bs = self.options.block_size
        positions = [s.kv_len for s in states]
        slots = [s.blocks[p // bs] * bs + p % bs for s, p in zip(states, positions, strict=True)]
        packed = [tokens, positions, slots, [s.row for s in states], sources]
        for s in states:
            s.kv_len += 1
        if self.graphs is not None and self.graphs.fits(n):
            logits, out_tokens, logprobs = self.graphs.replay(packed)
            if filtered:
                rows = torch.tensor(packed[3], dtype=torch.long, device=self.device)
                pos = torch.tensor(packed[1], dtype=torch.long, device=self.device) + 1
                out_tokens, logprobs = self._sample_device(logits, rows, pos, filtered=True)
        else:
            dev = torch.tensor(packed, dtype=torch.long).to(self.device)
            given, pos, slot_t, rows, src = dev[0], dev[1], dev[2], dev[3], dev[4]
            ids = torch.where(src >= 0, self.last_tokens[src.clamp(min=0)], given)
            meta: GatherMeta | PagedMeta
            if self.device.type == "cuda":
                meta = PagedMeta(self.block_tables, rows.to(torch.int32), (pos + 1).to(torch.int32))
            else:
                meta = gather_meta(
                    [1] * n,
                    [s.kv_len for s in states],
                    [s.blocks for s in states],
                    self.options.block_size,
                    "cpu",
                )
            scope: Any = contextlib.nullcontext()
            if self.lora is not None and any(s.lora_slot for s in states):
                scope = self.lora.tokens(self.lora_rows[rows])
            with scope:
                logits = self.model.forward(StepInputs(ids, pos, slot_t, None, meta))
            out_tokens, logprobs = self._sample_device(logits, rows, pos + 1, filtered=filtered)
        self.last_tokens[:n].copy_(out_tokens)
        routed = self._copy_decode_routing(states, positions)
        staging = None
        if self._staging is not None:
            staging = self._staging[self._launches % 2]
        self._launches += 1
        pending = PendingSamples(out_tokens, logprobs, staging)
        pending.routed = routed
        return pending

    def lora_layout_changed(self) -> None:
        """LoRA stacks were allocated or freed (under the step lock): the decode graphs, which hold
        their addresses and whether the hooks run at all, are captured again (now, so no request
        waits for it; after a memory release, at the first decode)."""
        if self.graphs is None:
            return
        self.graphs.drop()
        if self.pool.allocated:
            log.info("LoRA adapter modules changed: capturing the decode graphs again")
            with torch.inference_mode():
                self.graphs.capture()

    # ---------------------------------------------------------------- memory

    def release_memory(self) -> int:
        """Free the KV pool (nothing may be running); returns the bytes the pool held.

        The decode graphs are kept: if the pool comes back at the same addresses they are still
        valid, and capturing them again costs more than the rest of a resume."""
        if self.allocator.num_free != self.allocator.num_blocks - 1:
            raise RuntimeError("the KV pool cannot be released while requests hold blocks")
        self._released_at = self.pool.addresses()
        return self.pool.release()

    def resume_memory(self) -> None:
        if self.pool.allocated:
            return  # not released: the blocks in use must keep their accounting
        self.pool.resume()
        self.allocator.reset()
        self.model.pool = self.pool
        if self.graphs is not None and self.pool.addresses() != self._released_at:
            # The graphs read the pool at its old addresses: capture them again now, so the time is the
            # resume's and not the first request's.
            log.info("the KV pool came back at other addresses: capturing the decode graphs again")
            self.graphs.drop()
            with torch.inference_mode():
                self.graphs.capture()
        self._released_at = None
