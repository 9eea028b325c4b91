"""The batching loop: one thread that owns the model's forward passes.

Requests wait in a FIFO queue. Each scheduler step decodes one token for every
running row, then admits waiting requests up to ``max_batch_size`` (prefilled
together and merged into the running batch), then retires finished rows and
answers them. Every change to the running batch happens under ``step_lock``; a
weight update takes the same lock, so it lands between two steps, never inside a
forward pass.

Pause modes (``/pause_generation``), as in SGLang:

- ``abort``: every running and queued request is answered with finish reason
  ``abort`` (with the tokens it had so far). Requests that arrive while paused wait.
- ``retract``: running requests go back to the front of the queue with their
  tokens so far; on continue they are prefilled again (under the then-current
  weights, reusing the prefix cache like any request) and keep generating. Their
  KV cache is dropped.
- ``in_place``: the batch stops after the current step and keeps its KV cache;
  continue resumes it where it stopped.

Prefix cache (``prefix_cache``; none for models whose caches cannot be merged):
every admitted request looks up the longest cached prefix of its tokens, and its
prefill feeds only the rest; every request that finishes (stop or length, not
aborted or failed) stores the KV of the tokens it consumed (with their routing when
it recorded routing). A request does not take from the cache the positions whose
input log-probs it must compute (it needs their logits); a request that returns
routed experts uses only entries that recorded routing (the cached positions'
routing is then the entry's, as SGLang keeps routing with its KV cache).
The cache is flushed (under ``step_lock``) on every weight change and by
``/flush_cache``; a request whose KV was started before a flush is not stored (its
KV may predate the weights). Counters in ``stats``: ``prefix_cache_lookups``,
``prefix_cache_hits``, ``cached_tokens`` (tokens taken from the cache) and
``prefilled_tokens`` (tokens fed by prefills, padding excluded; counted with or
without a cache).

Scoring requests (input log-probs, see ``sampler``) go through the same queue:
their prompt is scored by the prefill that admits them, batched with whatever
else is admitted in that step; a pure scoring request (``max_new_tokens == 0``)
is answered right after that prefill and never joins a decode step. A request
that needs no forward pass at all (no new tokens, no input log-probs to
compute) is answered at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from miles.engines.embedded.prefix_cache import PrefixCache, PrefixHit
from miles.engines.embedded.sampler import DecodeBatch, GenRequest, Runner, merge_batches, row_kv, select_rows

log = logging.getLogger("miles.engines.embedded")

PAUSE_MODES = ("abort", "retract", "in_place")


class FifoLock:
    """A lock that serves waiters in arrival order (the ``with`` / acquire / release of a Lock).

    ``step_lock`` is retaken by the scheduler thread right after every step; with a plain
    Lock a weight update or a pause waiting for it could lose every race until the batch
    drains (seen with millisecond CUDA-graph steps). Here the next step waits its turn.
    Not reentrant, like the Lock it replaces.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the ticket the next caller draws
        self._serving = 0  # the ticket that holds the lock

    def acquire(self) -> bool:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()
        return True

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def locked(self) -> bool:
        with self._cond:
            return self._next != self._serving

    def waiting(self) -> int:
        """How many callers are queued behind the holder."""
        with self._cond:
            return max(0, self._next - self._serving - 1)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        *,
        max_batch_size: int,
        mergeable: bool,
        version: Callable[[], int] = lambda: 0,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if prefix_cache is not None and not mergeable:
            # A stored entry is one row cut out of a batch cache, which needs plain DynamicLayers.
            raise ValueError("a prefix cache needs a model whose caches can be merged (cache_is_mergeable)")
        self.runner = runner
        self.prefix_cache = prefix_cache  # used only under step_lock
        # The weight version each new token is sampled under (it changes only between steps,
        # under step_lock, so one step's tokens share one version).
        self.version = version
        self.max_batch_size = max_batch_size
        self.mergeable = mergeable
        self.step_lock = FifoLock()  # held for every step and every batch or weight change
        self._lock = threading.Lock()  # guards the queue and the flags below (taken after step_lock)
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._batch: DecodeBatch | None = None
        self._num_running = 0
        self._rids: set[str] = set()
        self.paused = False
        self.pause_mode: str | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="miles-scheduler", daemon=True)
        self.stats: dict[str, Any] = {
            "prefill_batches": 0,
            "prefill_requests": 0,
            "max_prefill_batch": 0,
            "decode_steps": 0,
            "decode_rows": 0,
            "max_decode_batch": 0,
            "requests_finished": 0,
            "requests_aborted": 0,
            "tokens_generated": 0,
            "scoring_requests": 0,
            "input_positions_scored": 0,
            "errors": 0,
            "prefix_cache_lookups": 0,
            "prefix_cache_hits": 0,
            "cached_tokens": 0,
            "prefilled_tokens": 0,
        }

    # ------------------------------------------------------------- public API

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=30)
        with self.step_lock:
            self._abort_everything("engine shutting down")

    def has_rid(self, rid: str) -> bool:
        with self._lock:
            return rid in self._rids

    def submit(self, req: GenRequest) -> None:
        """Queue a request; ``req.on_done`` is called once it finishes (from another thread)."""
        with self._lock:
            if req.rid in self._rids:
                raise ValueError(f"a request with rid {req.rid!r} is already in flight")
            if self._stop:
                raise RuntimeError("the engine is shutting down")
            self._rids.add(req.rid)
            if req.max_new_tokens == 0 and req.pending_input_positions == 0:
                req.finish = {"type": "length", "length": 0}
            else:
                self._waiting.append(req)
                self._wake.notify_all()
                return
        self._done(req)

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort one request (or all); blocks until the scheduler has answered them. Returns how many."""
        with self.step_lock:
            with self._lock:
                queued = [r for r in self._waiting if abort_all or r.rid == rid]
                for r in queued:
                    self._waiting.remove(r)
                running = [r for r in (self._batch.rows if self._batch else []) if abort_all or r.rid == rid]
                for r in running:
                    r.abort_requested = True
            for r in queued:
                self._finish_abort(r)
            self._retire()
        return len(queued) + len(running)

    def request_abort_nowait(self, rid: str) -> None:
        """Flag a request for abort without waiting (used when its HTTP caller went away)."""
        with self._lock:
            for r in self._waiting:
                if r.rid == rid:
                    r.abort_requested = True
            for r in self._batch.rows if self._batch else []:
                if r.rid == rid:
                    r.abort_requested = True
            self._wake.notify_all()

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        with self._lock:
            self.paused, self.pause_mode = True, mode
        with self.step_lock:  # waits for the step in progress
            if mode == "abort":
                self._abort_everything("generation paused (mode abort)")
            elif mode == "retract":
                self._retract_all()

    def _retract_all(self) -> None:
        """Send every running request back to the front of the queue (under ``step_lock``)."""
        if self._batch is None:
            return
        rows, self._batch = self._batch.rows, None
        with self._lock:
            self._num_running = 0
            self._waiting.extendleft(reversed(rows))

    def resume(self) -> None:
        with self._lock:
            self.paused, self.pause_mode = False, None
            self._wake.notify_all()

    def flush_prefix_cache(self) -> int:
        """Drop the prefix cache; returns how many entries it held. The caller holds ``step_lock``
        (a weight change is made under it; ``/flush_cache`` takes it)."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def prefix_cache_info(self) -> dict[str, Any] | None:
        """The prefix cache's size and counters (None: no cache), for ``/get_server_info``."""
        return self.prefix_cache.describe() if self.prefix_cache is not None else None

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self._num_running, len(self._waiting)

    # ------------------------------------------------------------- the loop

    def _has_work(self) -> bool:
        return bool(self._waiting) or self._num_running > 0 or self._aborts_pending()

    def _aborts_pending(self) -> bool:
        return any(r.abort_requested for r in self._waiting)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and (self.paused or not self._has_work()):
                    if self.paused and self._aborts_pending():
                        break
                    self._wake.wait()
                if self._stop:
                    return
            with self.step_lock:
                try:
                    self._step()
                except Exception as exc:  # a broken forward must not kill the engine
                    log.error("scheduler step failed:\n%s", traceback.format_exc())
                    self.stats["errors"] += 1
                    self._fail_everything(f"{type(exc).__name__}: {exc}")

    def _step(self) -> None:
        # Queued requests whose caller went away are answered without running them.
        with self._lock:
            dropped = [r for r in self._waiting if r.abort_requested]
            for r in dropped:
                self._waiting.remove(r)
        for r in dropped:
            self._finish_abort(r)
        if self.paused:
            self._retire()
            return
        if self._batch is not None:
            self.runner.decode(self._batch)
            self._stamp_versions(self._batch.rows)
            n = len(self._batch)
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += n
            self.stats["max_decode_batch"] = max(self.stats["max_decode_batch"], n)
            self._retire()
        new = self._admit()
        if new:
            scored = [r.pending_input_positions for r in new if r.pending_input_positions > 0]
            hits = self._lookup(new)
            try:
                fresh = self.runner.prefill(new, hits)
            except Exception as exc:
                # These rows are not in the running batch yet: answer them here, or their callers
                # would wait forever; the step's error then fails the running batch as usual.
                for row in new:
                    row.error = f"{type(exc).__name__}: {exc}"
                    row.finish = {"type": "abort", "message": row.error}
                    self._done(row)
                raise
            self._stamp_versions(new)
            self.stats["scoring_requests"] += len(scored)
            self.stats["input_positions_scored"] += sum(scored)
            self.stats["prefill_batches"] += 1
            self.stats["prefill_requests"] += len(new)
            self.stats["max_prefill_batch"] = max(self.stats["max_prefill_batch"], len(new))
            self._batch = merge_batches(self._batch, fresh)
            self._retire()

    def _lookup(self, rows: list[GenRequest]) -> list[PrefixHit | None]:
        """Each row's prefix-cache hit (None: a miss, or no cache), with the prefill counters."""
        cache = self.prefix_cache
        hits: list[PrefixHit | None] = []
        for row in rows:
            tokens = row.sequence
            hit = None
            # KV computed with a LoRA adapter differs from the base's: adapter rows neither reuse nor store.
            if cache is not None and row.lora is None:
                row.kv_generation = cache.generation
                # At least the last token is fed: its logits give the next token.
                limit = len(tokens) - 1
                if row.pending_input_positions > 0 and row.logprob_start is not None:  # (always set then)
                    limit = min(limit, row.logprob_start)  # scored positions need their logits
                hit = cache.lookup(tokens, limit, need_routing=row.return_routed_experts)
                self.stats["prefix_cache_lookups"] += 1
            cached = hit.length if hit is not None else 0
            if hit is not None:
                self.stats["prefix_cache_hits"] += 1
                self.stats["cached_tokens"] += cached
            if not row.output_ids:  # a retracted row reports what its first prefill reused
                row.cached_tokens = min(cached, len(row.prompt_ids))
            self.stats["prefilled_tokens"] += len(tokens) - cached
            hits.append(hit)
        return hits

    def _store(self, batch: DecodeBatch, i: int) -> None:
        """Keep finished row ``i``'s KV in the prefix cache, when it is complete and current."""
        row, cache = batch.rows[i], self.prefix_cache
        if cache is None or row.error is not None or row.kv_generation != cache.generation:
            return
        if row.lora is not None:  # adapter KV must never serve a base (or another adapter's) request
            return
        if row.finish is None or row.finish.get("type") not in ("stop", "length"):
            return
        tokens = row.sequence[: row.num_fed]
        kv = row_kv(batch, i)
        if kv[0][0].shape[2] != len(tokens):  # an invariant of the batch layout; never cache a doubt
            log.warning(
                "request %s: its KV covers %d tokens, it consumed %d; not cached",
                row.rid,
                kv[0][0].shape[2],
                len(tokens),
            )
            return
        routed = None
        if row.return_routed_experts and row.num_routed == len(tokens):
            routed = torch.cat(row.routed)
        cache.insert(tokens, kv, routed)

    def _stamp_versions(self, rows: list[GenRequest]) -> None:
        version = self.version()
        for row in rows:
            missing = len(row.output_ids) - len(row.output_versions)
            if missing > 0:
                row.output_versions.extend([version] * missing)

    def _admit(self) -> list[GenRequest]:
        running = len(self._batch) if self._batch is not None else 0
        if running and not self.mergeable:
            return []
        with self._lock:
            room = self.max_batch_size - running
            new: list[GenRequest] = []
            while self._waiting and len(new) < room:
                new.append(self._waiting.popleft())
            self._num_running = running + len(new)
            return new

    def _retire(self) -> None:
        """Answer finished or aborted rows and drop them from the batch."""
        if self._batch is None:
            return
        keep: list[int] = []
        done: list[GenRequest] = []
        for i, row in enumerate(self._batch.rows):
            if row.finish is None and row.abort_requested:
                row.finish = {"type": "abort", "message": "aborted by request"}
            if row.finish is None:
                keep.append(i)
            else:
                done.append(row)
        if not done:
            return
        if self.prefix_cache is not None:
            for i, row in enumerate(self._batch.rows):
                if row.finish is not None:
                    self._store(self._batch, i)
        self._batch = select_rows(self._batch, keep, self.mergeable)
        with self._lock:
            self._num_running = len(keep)
        for row in done:
            self._done(row)

    def _finish_abort(self, row: GenRequest, message: str = "aborted by request") -> None:
        row.finish = {"type": "abort", "message": message}
        self._done(row)

    def _take_running(self) -> list[GenRequest]:
        """Take every running row out of the running batch (the paged scheduler keeps its own)."""
        rows = self._batch.rows if self._batch is not None else []
        self._batch = None
        return rows

    def _abort_everything(self, message: str) -> None:
        rows = self._take_running()
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
            self._num_running = 0
        for row in [*rows, *queued]:
            self._finish_abort(row, message)

    def _fail_everything(self, error: str) -> None:
        rows = self._take_running()
        with self._lock:
            self._num_running = 0
        for row in rows:
            row.error = error
            row.finish = row.finish or {"type": "abort", "message": error}
            self._done(row)

    def _done(self, row: GenRequest) -> None:
        with self._lock:
            self._rids.discard(row.rid)
            if row.finish and row.finish.get("type") == "abort":
                self.stats["requests_aborted"] += 1
            self.stats["requests_finished"] += 1
            self.stats["tokens_generated"] += len(row.output_ids)
        if row.on_done is not None:
            row.on_done(row)
