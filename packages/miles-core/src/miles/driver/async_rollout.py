"""The fully asynchronous rollout worker: keeps the engines busy while the trainer trains.

A background thread runs its own event loop. It keeps up to ``max_inflight``
trajectories generating and starts a new group (``n_samples_per_prompt``
trajectories of one prompt) whenever the replacement rule frees enough places:

- ``sample``: each trajectory frees its place as soon as its generation ends (the
  rollout function calls ``ctx.on_generation_done``); a new group starts once a
  group's worth of places is free. One slow trajectory holds one place, not ``n``.
- ``group``: a group's places free only when the whole group has come back.

Finished groups go to the buffer one at a time; while a put is blocked (the buffer
is full) no new group starts, so a full buffer throttles generation instead of
piling finished groups up in memory. ``pause_production`` stops new groups without
touching the ones in flight (evaluation on the shared engines uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from miles.errors import MilesError
from miles.interfaces import Buffer, DataSource, RolloutContext, RolloutFn
from miles.types import Group, Prompt, Sample

log = logging.getLogger(__name__)

REPLACEMENT_RULES = ("sample", "group")


class RolloutWorkerError(RuntimeError):
    """The background rollout worker died; the message carries its traceback."""


class Slots:
    """Places for trajectories in flight; a group starts only when ``group_size`` are free."""

    def __init__(self, capacity: int, group_size: int) -> None:
        if capacity < group_size:
            raise ValueError(
                f"fully_async.max_inflight ({capacity}) must be at least n_samples_per_prompt ({group_size}): "
                "a group is started whole"
            )
        self.capacity = capacity
        self.group_size = group_size
        self.in_use = 0
        self.changed = asyncio.Event()

    @property
    def free(self) -> int:
        return self.capacity - self.in_use

    def acquire_group(self) -> None:
        assert self.free >= self.group_size
        self.in_use += self.group_size

    def release(self, n: int) -> None:
        self.in_use -= n
        assert self.in_use >= 0, "released more trajectory slots than were taken"
        self.changed.set()


class AsyncRolloutWorker:
    """Generates groups continuously into ``buffer``; the driver only takes from the buffer."""

    def __init__(
        self,
        rollout_fn: RolloutFn,
        make_context: Callable[[], RolloutContext],
        data_source: DataSource,
        buffer: Buffer,
        *,
        max_inflight: int,
        replacement: str,
        postprocess: Callable[[list[Group]], None] | None = None,
    ) -> None:
        if replacement not in REPLACEMENT_RULES:
            raise ValueError(f"replacement rule {replacement!r} is not one of {REPLACEMENT_RULES}")
        self.rollout_fn = rollout_fn
        self.make_context = make_context
        self.data_source = data_source
        self.buffer = buffer
        self.max_inflight = max_inflight
        self.replacement = replacement
        self.postprocess = postprocess
        self.served_version = 0  # the driver sets it after every weight update
        self.step = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_thread, name="miles-rollout-worker", daemon=True)
        self._error: str | None = None
        self._exc: BaseException | None = None
        self._stopping = False
        self._paused = 0
        self._pause_lock = threading.Lock()
        self._counters = {"groups_started": 0, "groups_finished": 0, "samples_finished": 0}
        self._inflight_samples = 0
        self._ctx: RolloutContext | None = None
        self._slots: Slots | None = None
        self._ready = threading.Event()
        self._to_buffer: queue.Queue[Group | None] = queue.Queue()  # finished groups, for the putter
        self._put_pending = 0

    # ------------------------------------------------------------- driver API

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        self.check()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop starting groups, cancel the ones in flight, close the loop's clients."""
        if not self._thread.is_alive():
            return
        self._stopping = True
        self._loop.call_soon_threadsafe(self._cancel_all)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the rollout worker did not stop within %.0f s", timeout_s)

    def check(self) -> None:
        """Raise if the worker died (the driver calls it while it waits for a batch)."""
        if isinstance(self._exc, MilesError):
            raise self._exc  # one line the user can act on (e.g. the fleet lost its engines)
        if self._error is not None:
            raise RolloutWorkerError(f"the fully asynchronous rollout worker failed:\n{self._error}")

    def set_version(self, version: int, step: int) -> None:
        self.served_version, self.step = version, step

    @contextlib.contextmanager
    def pause_production(self) -> Iterator[None]:
        """No new group starts inside this block; groups already generating finish normally."""
        with self._pause_lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._pause_lock:
                self._paused -= 1
            self._loop.call_soon_threadsafe(self._wake)

    def metrics(self) -> dict[str, float]:
        counters = dict(self._counters)
        return {
            "inflight_samples": float(self._inflight_samples),
            "max_inflight": float(self.max_inflight),
            **{k: float(v) for k, v in counters.items()},
        }

    # ------------------------------------------------------------ the thread

    def _run_thread(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except asyncio.CancelledError:
            pass
        except BaseException:
            self._error = traceback.format_exc()
            log.error("rollout worker failed:\n%s", self._error)
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._close_context())
            self._loop.close()

    async def _main(self) -> None:
        self._ctx = self.make_context()  # clients bound to this loop
        group_size = self._ctx.n_samples_per_prompt
        self._slots = Slots(self.max_inflight, group_size)
        self._ready.set()
        self._put_pending = 0
        tasks: set[asyncio.Task] = set()
        putter = threading.Thread(target=self._put_forever, name="miles-buffer-put", daemon=True)
        putter.start()
        self._main_task = asyncio.current_task()
        try:
            while not self._stopping:
                if not self._may_start():
                    self._slots.changed.clear()
                    await self._slots.changed.wait()
                    continue
                prompt = (await asyncio.to_thread(self.data_source.next_prompts, 1))[0]
                self._slots.acquire_group()
                self._counters["groups_started"] += 1
                task = asyncio.create_task(self._run_group(prompt))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(self._surface_failure)
        finally:
            self._to_buffer.put(None)  # ends the putter (unless a put is blocked: it is a daemon)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _may_start(self) -> bool:
        assert self._slots is not None
        return (
            not self._paused
            and self._put_pending == 0
            and self._slots.free >= self._slots.group_size
            and self._error is None
        )

    async def _run_group(self, prompt: Prompt) -> None:
        assert self._ctx is not None and self._slots is not None
        slots = self._slots
        generating = held = slots.group_size  # trajectories still generating / places still held
        self._inflight_samples += generating

        def generation_done(sample: Sample) -> None:
            nonlocal generating, held
            if generating > 0:
                generating -= 1
                self._inflight_samples -= 1
                self._counters["samples_finished"] += 1
            if self.replacement == "sample" and held > 0:
                held -= 1
                slots.release(1)

        ctx = dataclasses.replace(
            self._ctx, on_generation_done=generation_done, step=self.step, served_version=self.served_version
        )
        try:
            groups = await self.rollout_fn(ctx, [prompt])
        finally:
            # What a rollout function did not report per trajectory is released with the group.
            self._inflight_samples -= generating
            slots.release(held)
        if self.postprocess is not None:
            self.postprocess(groups)
        self._counters["groups_finished"] += len(groups)
        for group in groups:
            self._put_pending += 1
            self._to_buffer.put(group)

    def _put_forever(self) -> None:
        """The only caller of ``buffer.put``, one group at a time (it blocks while the buffer is full).

        A daemon thread of its own, not the loop's executor: a put still blocked when the run
        ends must not keep the process from exiting.
        """
        while True:
            group = self._to_buffer.get()
            if group is None:
                return
            try:
                self.buffer.put(group)
            except BaseException:
                self._error = traceback.format_exc()
                self._stopping = True
            finally:
                with contextlib.suppress(RuntimeError):  # the loop may be closed already
                    self._loop.call_soon_threadsafe(self._put_done)

    def _put_done(self) -> None:
        self._put_pending -= 1
        self._wake()

    def _surface_failure(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self._exc = exc
        self._error = "".join(traceback.format_exception(exc))
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        if self._slots is not None:
            self._slots.changed.set()

    def _cancel_all(self) -> None:
        task = getattr(self, "_main_task", None)
        if task is not None:
            task.cancel()

    async def _close_context(self) -> None:
        if self._ctx is None:
            return
        for obj in [*self._ctx.engines, self._ctx.reward, *self._ctx.reward_postprocess, *self._ctx.scorers]:
            close = getattr(obj, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()


def default_max_inflight(prompts_per_step: int, n_samples_per_prompt: int) -> int:
    """Two training batches' worth of trajectories: enough to cover a step's straggler."""
    return 2 * prompts_per_step * n_samples_per_prompt


class AsyncGeneration:
    """The fully asynchronous schedule as the driver sees it: collect a batch, change weights.

    ``collect`` takes ``prompts_per_step`` groups from the buffer (which the worker keeps
    filling), waiting as long as it must. ``weights_changing`` brackets a weight update:
    the engines pause in the configured mode (retract, in_place or abort) for exactly
    the reload, and resume afterwards.
    """

    METRICS_PREFIX = "rollout/fully_async/"

    def __init__(
        self,
        worker: AsyncRolloutWorker,
        buffer: Buffer,
        drops: Any,
        engines: list[Any],
        loop: asyncio.AbstractEventLoop,
        *,
        prompts_per_step: int,
        update_mode: str,
        take_timeout_s: float,
    ) -> None:
        self.worker = worker
        self.buffer = buffer
        self.drops = drops
        self.engines = engines
        self.loop = loop
        self.prompts_per_step = prompts_per_step
        self.update_mode = update_mode
        self.take_timeout_s = take_timeout_s

    def collect(self, step: int) -> tuple[list[Group], dict[str, float]]:
        from miles.driver.generation import rollout_metrics

        t0 = time.perf_counter()
        self.worker.set_version(self.worker.served_version, step)
        batch: list[Group] = []
        last_progress = t0
        while len(batch) < self.prompts_per_step:
            self.worker.check()
            got = self.buffer.take(self.prompts_per_step - len(batch), weight_version=step, timeout_s=1.0)
            now = time.perf_counter()
            if got:
                batch.extend(got)
                last_progress = now
            elif now - last_progress > self.take_timeout_s:
                raise RolloutWorkerError(
                    f"step {step}: the buffer yielded no group for {self.take_timeout_s:.0f} s "
                    f"({len(batch)}/{self.prompts_per_step} collected; fully_async.take_timeout_s)"
                )
        waited = time.perf_counter() - t0
        # Groups in step order of their prompts, as a synchronous step would have them.
        batch.sort(key=lambda g: g.prompt.index)
        metrics = rollout_metrics(batch, batch, self.drops.drain(), waited)
        metrics["time/wait_for_batch_s"] = waited
        metrics |= {self.METRICS_PREFIX + k: v for k, v in self.buffer.metrics().items()}
        metrics |= {self.METRICS_PREFIX + k: v for k, v in self.worker.metrics().items()}
        return batch, metrics

    @contextlib.contextmanager
    def weights_changing(self, version: int) -> Iterator[None]:
        from miles.engines.health import call_each

        # call_each skips quarantined engines and reports one that does not answer (the fleet
        # recovers it during the update) instead of failing the pause, or hanging on a stopped one.
        self.loop.run_until_complete(call_each(self.engines, "pause_generation", self.update_mode))
        try:
            yield
        finally:
            self.loop.run_until_complete(call_each(self.engines, "continue_generation"))
        self.worker.set_version(version, self.worker.step)

    def close(self) -> None:
        self.worker.stop()
