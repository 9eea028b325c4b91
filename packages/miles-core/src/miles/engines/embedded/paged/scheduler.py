"""The paged batching loop: continuous batching over the paged KV pool, with chunked prefill.

It keeps the behaviour of :class:`~miles.engines.embedded.scheduler.Scheduler` (one
thread, every step under ``step_lock`` so weight updates land between steps, pause
modes ``abort`` / ``retract`` / ``in_place``, aborts, weight versions per token) and
changes how a step is made. Each step:

1. decodes one token for every running request whose prompt is fully in the pool
   (one forward; a CUDA graph on the GPU);
2. feeds at most ``chunk_tokens`` prompt tokens: first the rest of the prompts being
   prefilled, then new requests from the queue, so a long prompt is cut in chunks
   and never stalls the running decodes for more than one chunk.

Admission is by free blocks: a request enters only when the pool has blocks for its
whole prompt plus the first token (and a table row is free: ``max_batch_size``).
When a decoding request needs a new block and none is free, the newest other
running request is *retracted*: its blocks are given back and it goes to the front
of the queue with its tokens and log-probs, to be prefilled again (prompt and
outputs) when blocks free up; its seeded draws do not change, since the sampler's
noise depends only on (seed, position).

Prefix cache (``radix``, see ``paged/radix.py``): a request admitted from the queue
takes the longest cached prefix of its tokens, in whole blocks, into its block table
(the blocks are shared, not copied) and prefills only the rest; it never takes the
last token it must feed (its logits sample the next token), nor positions whose input
log-probs it needs, and rows that return routed experts do not look up (the tree keeps
no routing). Every request leaving the running set (finished, aborted, retracted; not
failed, and not one whose KV was started before the last flush) gives its complete
blocks to the tree before letting go of its own references. When blocks run short,
least recently used cached blocks nobody else holds are evicted before any running
request is retracted. Weight changes and ``/flush_cache`` flush the tree; so does a
memory release, before the pool goes.

LoRA (``paged/lora.py``): a request with ``lora`` gets its adapter's slot when it is admitted
(one that names an adapter unloaded since it was accepted is answered with an abort naming
it); the runner applies the slot to its tokens. Its KV is cached and looked up in its
adapter's own tree of the prefix cache (the namespace is the adapter's name), so base and
adapter rows never share blocks; replacing or unloading an adapter drops its tree.

Not on this path (see ``docs/engine.md``): requests that want
input log-probs *and* new tokens, or top-k / requested-id log-probs of sampled
tokens (refused with a message naming ``--kv-cache dynamic``). Pure scoring
requests (``max_new_tokens`` 0) are scored by the DynamicCache runner inside a step.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from miles.engines.embedded.paged.radix import RadixCache
from miles.engines.embedded.paged.runner import PagedRunner, PendingSamples, Sampled, SeqState
from miles.engines.embedded.sampler import GenRequest, Runner
from miles.engines.embedded.scheduler import Scheduler

log = logging.getLogger("miles.engines.embedded")

# Most decode steps launched back to back before the loop looks at its queue, pause and abort
# flags again (each check is cheap; this bounds how long a finished row's neighbours hold the loop).
MAX_OVERLAPPED_STEPS = 64


class _Running:
    """The running requests, in admission order (the parent class reads ``.rows``)."""

    def __init__(self) -> None:
        self.rows: list[GenRequest] = []

    def __len__(self) -> int:
        return len(self.rows)


def paged_refusal(req: GenRequest) -> str | None:
    """Why the paged path cannot serve ``req`` (None: it can)."""
    if req.max_new_tokens == 0:
        return None  # pure scoring: served by the DynamicCache runner
    if req.wants_extras:
        return (
            "top_logprobs_num / token_ids_logprob for generated tokens are not available on the paged KV "
            "cache path; score the finished sequence with a max_new_tokens 0 request, or start the engine "
            "with --kv-cache dynamic"
        )
    if req.pending_input_positions > 0:
        return (
            "input log-probs (logprob_start_len) together with generation are not available on the paged KV "
            "cache path; send a separate scoring request (max_new_tokens 0), or start the engine with "
            "--kv-cache dynamic"
        )
    return None


class PagedScheduler(Scheduler):
    def __init__(
        self,
        paged: PagedRunner,
        scorer: Runner,
        *,
        max_batch_size: int,
        chunk_tokens: int,
        version: Any = lambda: 0,
        seed: int | None = None,
        prefix_cache_tokens: int = 0,
    ) -> None:
        super().__init__(scorer, max_batch_size=max_batch_size, mergeable=True, version=version)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.paged = paged
        # The prefix cache over the pool's blocks (None: disabled); it never keeps more than the pool.
        self.radix: RadixCache | None = None
        if prefix_cache_tokens > 0:
            self.radix = RadixCache(
                paged.allocator, min(prefix_cache_tokens, paged.allocator.capacity_tokens)
            )
        self.chunk_tokens = chunk_tokens
        self._running = _Running()
        self._batch = self._running  # type: ignore[assignment]  # the parent reads .rows and len()
        self._states: dict[GenRequest, SeqState] = {}
        self._seeds = random.Random(seed)
        self.released = False
        self._prefilling = 0  # running rows whose prompt is not all in the pool (a hint: 0 skips the scan)
        self.stats.update(
            {
                "retractions": 0,
                "overlapped_steps": 0,  # decode steps launched before the previous one was read
                "prefill_chunks": 0,
                "kv_blocks_free": paged.allocator.num_free,
                # Wall seconds in decode forwards (read-back included), in prefill forwards, in steps.
                "decode_s": 0.0,
                "prefill_s": 0.0,
                "step_s": 0.0,
            }
        )

    # ------------------------------------------------------------- public API

    def submit(self, req: GenRequest) -> None:
        why = paged_refusal(req)
        if why is not None:
            raise ValueError(why)
        super().submit(req)

    def release_memory(self) -> int:
        """Retract every running request, flush the prefix cache and free the KV pool; returns the
        bytes freed."""
        with self.step_lock:
            self._retract_all()
            self.flush_prefix_cache()  # the cached blocks live in the pool that goes away
            with self._lock:
                self.released = True
            return self.paged.release_memory()

    def resume_memory(self) -> None:
        with self.step_lock:
            self.paged.resume_memory()
            with self._lock:
                self.released = False
                self._wake.notify_all()

    def flush_prefix_cache(self) -> int:
        """Drop the tree's references (requests holding cached blocks keep theirs); returns how many
        blocks it held. The caller holds ``step_lock``."""
        return self.radix.flush() if self.radix is not None else 0

    def prefix_cache_info(self) -> dict[str, Any] | None:
        return self.radix.describe() if self.radix is not None else None

    def flush_adapter_cache(self, name: str) -> int:
        """Drop the blocks cached under LoRA adapter ``name`` (its factors were replaced or it was
        unloaded); returns how many. The caller holds ``step_lock``."""
        return self.radix.flush_namespace(name) if self.radix is not None else 0

    def adapter_requests(self, name: str) -> int:
        """Requests running or queued with LoRA adapter ``name``. The caller holds ``step_lock``."""
        with self._lock:
            queued = sum(1 for r in self._waiting if r.lora == name)
        return queued + sum(1 for r in self._running.rows if r.lora == name)

    # ------------------------------------------------------------- the loop

    def _has_work(self) -> bool:
        if self.released:  # requests wait until the pool is back
            return self._aborts_pending()
        return super()._has_work()

    def _step(self) -> None:
        with self._lock:
            dropped = [r for r in self._waiting if r.abort_requested]
            for r in dropped:
                self._waiting.remove(r)
        for r in dropped:
            self._finish_abort(r)
        if self.paused or self.released:
            self._retire()
            return
        t0 = time.perf_counter()
        self._decode()
        self._retire()
        self._prefill()
        self._retire()
        self.stats["kv_blocks_free"] = self.paged.allocator.num_free
        self.stats["step_s"] += time.perf_counter() - t0

    def _state(self, row: GenRequest) -> SeqState:
        state = self._states.get(row)
        if state is None:
            seed = row.seed if row.seed is not None else self._seeds.getrandbits(63)
            state = self._states[row] = SeqState(seed=seed, routed=row.return_routed_experts)
        return state

    def _decode(self) -> None:
        # The per-row work here runs every step for every row: it is kept to plain attribute
        # reads (at batch 256 the host's share of a step is comparable to the GPU's).
        states = self._states
        slots_per_table = self.paged.options.block_size
        rows: list[GenRequest] = []
        grow: list[GenRequest] = []
        for r in self._running.rows:
            st = states[r]
            if r.finish is None and r.output_ids and st.kv_len == len(r.prompt_ids) + len(r.output_ids) - 1:
                rows.append(r)
                if st.kv_len >= len(st.blocks) * slots_per_table:
                    grow.append(r)
        retracted: set[GenRequest] = set()
        for row in grow:
            if row in retracted:
                continue
            state = states[row]
            while not self._grow(state, state.kv_len + 1):  # evicts cached blocks before retracting
                victim = next((r for r in reversed(self._running.rows) if r is not row), None)
                if victim is None:
                    row.finish = {
                        "type": "abort",
                        "message": f"the KV pool ({self.paged.allocator.capacity_tokens} tokens) cannot hold "
                        f"this request's {state.kv_len + 1} tokens",
                    }
                    break
                self._retract(victim)
                retracted.add(victim)
        if retracted or grow:
            rows = [r for r in rows if r not in retracted and r.finish is None]
        if not rows:
            return
        # Overlapped decoding: while nothing else needs the scheduler (see _may_overlap), step N+1 is
        # launched before step N is read, its inputs being step N's samples still on the device, so
        # the host's bookkeeping of step N runs while the device computes step N+1.
        version = self.version()  # constant while step_lock is held: every token of the run shares it
        pending = self._launch(rows, None)
        steps = 1
        while True:
            following = self._following(rows) if self._may_overlap(steps) else []
            nxt = self._launch(following, rows) if following else None
            if nxt is not None:
                self.stats["overlapped_steps"] += 1
            self._record(rows, pending.read(), version)
            if nxt is None:
                return
            rows, pending = following, nxt
            steps += 1
            self._retire()  # finished rows are answered now, not at the end of the run of steps

    def _launch(self, rows: list[GenRequest], previous: list[GenRequest] | None) -> PendingSamples:
        """Launch the decode step of ``rows``: each feeds its last token, or, when ``previous`` (the
        rows of the step in flight, in their order) is given, the token that step samples for it."""
        states = self._states
        sts = [states[r] for r in rows]
        filtered = any(st.filtered for st in sts)
        t0 = time.perf_counter()
        if previous is None:
            last = [r.output_ids[-1] for r in rows]
            pending = self.paged.launch_decode(sts, last, [-1] * len(rows), filtered)
        else:
            where = {r: i for i, r in enumerate(previous)}
            pending = self.paged.launch_decode(sts, [0] * len(rows), [where[r] for r in rows], filtered)
        self.stats["decode_s"] += time.perf_counter() - t0
        n = len(rows)
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += n
        self.stats["max_decode_batch"] = max(self.stats["max_decode_batch"], n)
        return pending

    def _may_overlap(self, steps: int) -> bool:
        """Whether to launch another decode step before reading the one in flight: only while no one
        else needs the scheduler (a weight update, pause, abort or release waiting for step_lock;
        queued requests that could be admitted; prompts being prefilled), and a bounded number of
        steps at a time so the loop's other duties stay timely."""
        if not self.paged.options.overlap or steps >= MAX_OVERLAPPED_STEPS or self._prefilling:
            return False
        if self.step_lock.waiting() or self.paused or self.released:
            return False
        admissible = self._waiting and self.paged.free_rows > 0 and len(self._running) < self.max_batch_size
        return not admissible

    def _following(self, rows: list[GenRequest]) -> list[GenRequest]:
        """The rows of the step in flight that will decode again, whatever token it samples: not
        finished, not at their length limit with that token, and with a slot for the next token
        (cached blocks may be evicted for it; a running row is never retracted here: a row short of
        blocks ends the overlapped run instead, and the next step retracts as usual)."""
        states = self._states
        limit = min(self.runner.max_context, self.paged.max_context)
        out: list[GenRequest] = []
        for r in rows:
            if r.finish is not None or r.abort_requested:
                continue
            n_out = len(r.output_ids) + 1  # with the token in flight
            if n_out >= r.max_new_tokens or len(r.prompt_ids) + n_out >= limit:
                continue
            st = states[r]
            if not self._grow(st, st.kv_len + 1):  # evicted blocks: no step in flight reads them
                return []
            out.append(r)
        return out

    def _record(self, rows: list[GenRequest], out: Sampled, version: Any) -> None:
        """Append a read step's tokens to its rows and mark those that finished. A row that finished
        at the step before (a stop token the host had not read when this step was launched) ignores
        this step's token: its sequence ended there."""
        self._store_routing(out)
        limit = min(self.runner.max_context, self.paged.max_context)
        for row, tok, lp in zip(rows, out.tokens, out.logprobs, strict=True):
            if row.finish is not None:
                continue
            row.output_ids.append(tok)
            row.output_logprobs.append(lp)
            row.output_versions.append(version)  # (a decode row's versions are complete before it)
            n_out = len(row.output_ids)
            if tok in row.stop_ids:
                row.finish = {"type": "stop", "matched": tok}
            elif n_out >= row.max_new_tokens or len(row.prompt_ids) + n_out >= limit:
                row.finish = {"type": "length", "length": n_out}

    def _prefill(self) -> None:
        budget = self.chunk_tokens
        chunks: list[tuple[SeqState, list[int], bool]] = []
        sampled: list[GenRequest] = []

        def add(row: GenRequest, state: SeqState) -> None:
            nonlocal budget
            n = min(row.num_fed - state.kv_len, budget)
            if n <= 0:
                return
            want = state.kv_len + n == row.num_fed and not row.output_ids
            chunks.append((state, row.sequence[state.kv_len : state.kv_len + n], want))
            if want:
                sampled.append(row)
            budget -= n

        if self._prefilling:
            for row in self._running.rows:
                state = self._states[row]
                if state.kv_len < row.num_fed and budget > 0:
                    add(row, state)
        running = len(self._running)
        scoring = self._admit_into(add, lambda: budget)
        admitted = len(self._running) - running  # (a prefix-cache hit starts with kv_len > 0)
        if scoring:
            self._score(scoring)
        if not chunks:
            return
        t0 = time.perf_counter()
        out = self.paged.prefill(chunks)
        self.stats["prefill_s"] += time.perf_counter() - t0
        self._store_routing(out)
        self._prefilling = sum(1 for r in self._running.rows if self._states[r].kv_len < r.num_fed)
        for row, tok, lp in zip(sampled, out.tokens, out.logprobs, strict=True):
            self._append(row, tok, lp)
        self._stamp_versions(sampled)
        self.stats["prefill_batches"] += 1
        self.stats["prefill_chunks"] += len(chunks)
        self.stats["prefill_requests"] += admitted
        self.stats["max_prefill_batch"] = max(self.stats["max_prefill_batch"], len(chunks))
        self.stats["prefilled_tokens"] += self.chunk_tokens - budget

    def _admit_into(self, add: Any, budget: Any) -> list[GenRequest]:
        """Move queued requests into the running set while blocks, rows and the chunk budget allow;
        returns the pure scoring requests taken from the queue."""
        scoring: list[GenRequest] = []
        capacity = self.paged.allocator.capacity_tokens
        while budget() > 0:
            with self._lock:
                if not self._waiting:
                    break
                row = self._waiting[0]
                if row.max_new_tokens == 0:
                    self._waiting.popleft()
                    scoring.append(row)
                    continue
                if self.paged.free_rows == 0 or len(self._running) >= self.max_batch_size:
                    break
                state = self._state(row)
                need = row.num_fed + 1
                refusal = self._refusal(row, state, need, capacity)
                if refusal is None and not self._take_blocks(row, state, need):
                    break  # wait for blocks
                self._waiting.popleft()
                if refusal is None:
                    self._running.rows.append(row)
                    self._num_running = len(self._running)
            if refusal is not None:
                row.finish = {"type": "abort", "message": refusal}
                self._done(row)
                continue
            self.paged.attach(state, row.temperature, row.top_p, row.top_k)
            self._prefilling += 1
            add(row, state)
        return scoring

    def _refusal(self, row: GenRequest, state: SeqState, need: int, capacity: int) -> str | None:
        """Why a queued request cannot run at all (None: it can); also gives it its adapter slot."""
        if need > capacity:
            return f"the request needs {need} KV slots; the pool holds {capacity} (raise --mem-fraction or --kv-tokens)"
        if row.lora is not None:
            lora = self.paged.lora
            slot = lora.slot(row.lora) if lora is not None else None
            if slot is None:
                return f"LoRA adapter {row.lora!r} is not loaded (it was unloaded after the request came)"
            state.lora_slot = slot
        return None

    def _take_blocks(self, row: GenRequest, state: SeqState, need: int) -> bool:
        """Blocks for ``need`` token slots of an admitted ``row``: its cached prefix shared from the
        tree, the rest allocated (evicting cached blocks if the free list is short). False, with
        nothing held, when the pool cannot give them now."""
        radix = self.radix
        looked_up = False
        if radix is not None and not row.return_routed_experts:
            # Routed rows would need the routing of the cached positions, which the tree does not keep.
            # An adapter's rows look in that adapter's tree only (its KV is not the base's).
            tokens = row.sequence
            limit = len(tokens) - 1  # at least the last token is fed: its logits give the next token
            if row.pending_input_positions > 0 and row.logprob_start is not None:
                limit = min(limit, row.logprob_start)  # scored positions need their logits
            blocks = radix.match(tokens, limit, row.lora)
            if blocks:
                self.paged.allocator.share(blocks)  # before any eviction below, which then skips them
                state.blocks = blocks
                state.kv_len = len(blocks) * radix.block_size
            looked_up = True
        if not self._grow(state, need):
            self.paged.detach(state)  # gives the shared blocks back; the row holds no table row yet
            return False
        cached = state.kv_len
        if radix is not None:
            row.kv_generation = radix.generation
        if looked_up:
            self.stats["prefix_cache_lookups"] += 1
        if cached:
            self.stats["prefix_cache_hits"] += 1
            self.stats["cached_tokens"] += cached
        if not row.output_ids:  # a retracted row reports what its first prefill reused
            row.cached_tokens = min(cached, len(row.prompt_ids))
        return True

    def _grow(self, state: SeqState, tokens: int) -> bool:
        """``paged.grow``, first evicting least recently used cached blocks that only the prefix
        cache holds when the free list is short."""
        if self.paged.grow(state, tokens):
            return True
        if self.radix is None:
            return False
        alloc = self.paged.allocator
        short = alloc.blocks_for(tokens) - len(state.blocks) - alloc.num_free
        if self.radix.evict(short) < short:
            return False
        return self.paged.grow(state, tokens)

    def _cache_blocks(self, row: GenRequest, state: SeqState) -> None:
        """Give the tree ``row``'s complete blocks (before the row lets go of them)."""
        radix = self.radix
        if radix is None or row.error is not None:
            return  # a failed step may have left the KV half written
        if row.kv_generation != radix.generation:
            return  # started before a flush: part of its KV may come from weights that are gone
        full = state.kv_len // radix.block_size
        if not full:
            return
        try:
            radix.insert(row.sequence[: full * radix.block_size], state.blocks[:full], row.lora)
        except Exception:  # a cache that cannot take these blocks must not fail the request
            log.exception("request %s: its KV blocks were not cached", row.rid)

    def _score(self, rows: list[GenRequest]) -> None:
        """Pure scoring requests, through the DynamicCache runner (exact input log-probs)."""
        try:
            self.runner.prefill(rows)
        except Exception as exc:
            for row in rows:
                row.error = f"{type(exc).__name__}: {exc}"
                row.finish = {"type": "abort", "message": row.error}
                self._done(row)
            raise
        self.stats["scoring_requests"] += len(rows)
        self.stats["input_positions_scored"] += sum(len(r.input_logprobs) for r in rows)
        for row in rows:
            self._done(row)

    def _store_routing(self, out: Sampled) -> None:
        """Move a read step's routed experts into the requests that asked, in position order: one
        entry per consumed token, as on the DynamicCache path. Positions already recorded (a
        retracted request fed again) are skipped; a request that finished before this step (whose
        last token is never consumed there) or has left takes none."""
        if not out.routed:
            return
        owners = {id(state): row for row, state in self._states.items()}
        for state, first, experts in out.routed:
            row = owners.get(id(state))
            if row is None or row.finish is not None:
                continue
            skip = row.num_routed - first
            if skip < 0:
                raise RuntimeError(
                    f"request {row.rid}: the routed experts of positions {row.num_routed}..{first - 1} "
                    "were never recorded"
                )
            if skip < len(experts):
                row.routed.append(experts[skip:])
                row.num_routed = first + len(experts)

    def _append(self, row: GenRequest, token: int, logprob: float) -> None:
        row.output_ids.append(token)
        row.output_logprobs.append(logprob)
        limit = min(self.runner.max_context, self.paged.max_context)
        if token in row.stop_ids:
            row.finish = {"type": "stop", "matched": token}
        elif len(row.output_ids) >= row.max_new_tokens or len(row.prompt_ids) + len(row.output_ids) >= limit:
            row.finish = {"type": "length", "length": len(row.output_ids)}

    # ------------------------------------------------------- leaving the batch

    def _retract(self, row: GenRequest) -> None:
        """Give back ``row``'s blocks (its complete ones to the prefix cache, so that it takes them
        back when it runs again, unless they were evicted meanwhile) and put it at the front of the
        queue (tokens kept)."""
        state = self._states[row]
        self._cache_blocks(row, state)
        self.paged.detach(state)
        self._running.rows.remove(row)
        with self._lock:
            self._num_running = len(self._running)
            self._waiting.appendleft(row)
        self.stats["retractions"] += 1

    def _retract_all(self) -> None:
        for row in reversed(list(self._running.rows)):
            self._retract(row)

    def _retire(self) -> None:
        keep: list[GenRequest] = []
        done: list[GenRequest] = []
        for row in self._running.rows:
            if row.finish is None and row.abort_requested:
                row.finish = {"type": "abort", "message": "aborted by request"}
            (keep if row.finish is None else done).append(row)
        if not done:
            return
        self._running.rows = keep
        with self._lock:
            self._num_running = len(keep)
        for row in done:
            self._done(row)

    def _take_running(self) -> list[GenRequest]:
        rows, self._running.rows = self._running.rows, []
        return rows

    def _done(self, row: GenRequest) -> None:
        state = self._states.pop(row, None)
        if state is not None:
            self._cache_blocks(row, state)
            self.paged.detach(state)  # every way out of the scheduler gives the blocks back
        super()._done(row)
