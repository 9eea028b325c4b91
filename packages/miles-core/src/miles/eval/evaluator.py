"""The evaluator the driver calls: ``due`` / ``start`` / ``collect``, inside a ``with`` block.

Three modes (``eval.mode``), one bookkeeping:

- ``shared``: the rollout engines score the weights they serve. Production pauses
  (``pause_production``) and ``weights_lock`` is held for the whole evaluation, so no
  weight update lands in the middle of it. Under ``schedule: sync`` the engines idle
  between steps and the evaluation runs inline; under ``fully_async`` in the background.
- ``dedicated``: the driver thread exports a snapshot (the only pause for training);
  in the background every engine of the eval fleet loads it and must report its version
  before any sampling.
- ``external``: the same snapshot goes to an ``EvalBackend`` plugin.

Whatever happens, ``start`` does not raise for a failed evaluation: the result is
``skipped`` with a reason (``miles.eval.result.SKIP_REASONS``) and a warning is logged.
Results are recorded against the step whose weights they measured (weights of version
``v`` are the policy after step ``v - 1``) and reach the driver through ``collect``, which
fills in how many steps late they arrived and appends them to ``run_dir/eval.jsonl``.

Threads: rollouts run on the evaluator's own asyncio loop in its own thread (with its own
engine clients: HTTP sessions belong to one loop); each background evaluation has a
worker thread that waits on that loop (or on the external backend) and cleans up after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from miles.config.schema import MilesConfig
from miles.errors import ConfigError
from miles.eval.result import (
    BACKEND_ERROR,
    ENGINE_ERROR,
    OK,
    SKIPPED,
    TIMEOUT,
    TOO_MANY_OUTSTANDING,
    EvalLog,
    EvalResult,
    EvalSkipped,
)
from miles.eval.scoring import EvalScore, eval_set_from_config
from miles.eval.snapshot import export_snapshot, remove_snapshot
from miles.eval.versions import VersionStats
from miles.interfaces import EngineClient

log = logging.getLogger(__name__)

_STOP_GRACE_S = 30.0  # how long stopping may wait for cancelled rollouts and worker clean-up


@dataclass
class _Job:
    """One evaluation in progress."""

    step: int
    version: int
    started: float  # time.monotonic() at start()
    deadline: float
    snapshot: str | None = None
    export_s: float | None = None
    future: concurrent.futures.Future | None = None  # its rollout on the eval loop, if any
    result: EvalResult | None = (
        None  # set once: the first outcome wins (a late finish after a timeout is dropped)
    )
    done: threading.Event = field(default_factory=threading.Event)  # the work and its clean-up are over


class _EvalLoop:
    """An asyncio event loop running in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="miles-eval-loop", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, closers: list[Callable[[], Coroutine[Any, Any, None]]]) -> None:
        """Cancel what still runs, run ``closers`` (client sessions) in the loop, then end the thread."""

        async def shutdown() -> None:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for close in closers:
                try:
                    await close()
                except Exception:  # closing is best effort; the loop ends either way
                    log.debug("closing an eval client failed", exc_info=True)

        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                self.submit(shutdown()).result(timeout=_STOP_GRACE_S)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=_STOP_GRACE_S)
        if not self.thread.is_alive():
            self.loop.close()


class Evaluator:
    """Evaluates the policy every ``eval.every`` steps in the recipe's ``eval.mode``; see the module docstring.

    ``export_snapshot(directory)`` writes the current policy there as a Hugging Face
    checkpoint (``backend.export_hf``); ``pause_production()`` is a context manager during
    which no new training trajectory starts; ``weights_lock`` is the lock the driver holds
    while it updates the engines' weights. Call ``start`` without holding ``weights_lock``.
    """

    def __init__(
        self,
        config: MilesConfig,
        *,
        model_path: str,
        tokenizer: Any,
        run_dir: str,
        engine_urls: list[str],
        export_snapshot: Callable[[str], None],
        pause_production: Callable[[], contextlib.AbstractContextManager[None]],
        weights_lock: threading.Lock,
        services: dict[str, Any] | None = None,
    ) -> None:
        if config.eval is None:
            raise ConfigError("the recipe has no eval section, so there is nothing to evaluate")
        self.config = config
        self.cfg = config.eval
        self.mode = self.cfg.mode
        if self.mode == "shared" and not engine_urls:
            raise ConfigError("eval.mode 'shared' evaluates on the rollout engines, but the run has none")
        self.model_path = model_path
        self.run_dir = run_dir
        self.engine_urls = list(engine_urls)
        self.snapshot_root = os.path.join(run_dir, "eval_snapshots")
        self.log_path = os.path.join(run_dir, "eval.jsonl")
        self._export = export_snapshot
        self._pause = pause_production
        self._weights_lock = weights_lock
        self._inline = self.mode == "shared" and config.schedule == "sync"
        # Resolved now: a bad eval data path, reward or backend fails before the run starts training.
        self.eval_set = eval_set_from_config(config, _own_copy(tokenizer), services)
        self._backend = None
        if self.mode == "external":
            from miles.eval.external import make_eval_backend

            assert self.cfg.backend is not None  # the schema requires it for mode external
            self._backend = make_eval_backend(self.cfg.backend, dict(self.cfg.backend_options))
        self._log = EvalLog(self.log_path)
        self._state = threading.Lock()  # guards _jobs, _finished, _drained
        self._jobs: list[_Job] = []
        self._finished: list[EvalResult] = []
        self._drained: list[EvalResult] = []
        self._latest_step = -1
        self._loop: _EvalLoop | None = None
        self._clients: list[EngineClient] = []
        self._fleet: Any = None  # the dedicated fleet's launcher
        self._fleet_guard: asyncio.Lock | None = None  # one snapshot on the fleet at a time
        self.fleet_urls: list[str] = []
        self._open = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Evaluator:
        loop = _EvalLoop()
        loop.start()
        try:
            # Clients of the run's engine kind (its launcher's own client), on the rollout engines or
            # on the dedicated fleet; the external mode talks to no engine here.
            if self.mode == "shared":
                from miles.capabilities import engine_client_factory

                make_client = engine_client_factory(self.config)
                self._clients = [make_client(url) for url in self.engine_urls]
            elif self.mode == "dedicated":
                from miles.eval.dedicated import launch_fleet

                self._fleet, self.fleet_urls = launch_fleet(
                    self.config, self.model_path, os.path.join(self.run_dir, "eval_engines")
                )
                self._clients = [self._fleet.client(url) for url in self.fleet_urls]
        except BaseException:
            loop.stop([])
            if self._fleet is not None:
                self._fleet.shutdown()
            raise
        self._loop = loop
        self._open = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Wait up to ``eval.timeout_s`` for outstanding evaluations (not when the run failed), then stop."""
        if not self._open:
            return
        self._open = False
        with self._state:
            running = [j for j in self._jobs if not j.done.is_set()]
        if exc_type is None:
            deadline = time.monotonic() + self.cfg.timeout_s
            for job in running:
                job.done.wait(max(0.0, deadline - time.monotonic()))
            why = f"still running {self.cfg.timeout_s:g} s after the run's last step (eval.timeout_s)"
        else:
            why = f"the run stopped ({exc_type.__name__}) before this evaluation finished"
        for job in running:
            if not job.done.is_set():
                self._finish(job, EvalSkipped(TIMEOUT, why))
                if job.future is not None:
                    job.future.cancel()
        assert self._loop is not None
        # ``aclose`` is not part of EngineClient: a client that holds nothing open has none.
        closers = [c.aclose for c in self._clients if hasattr(c, "aclose")] + [self.eval_set.aclose]
        self._loop.stop(closers)
        for job in running:  # workers remove their snapshots once their rollout is cancelled
            job.done.wait(timeout=5.0)
        if self._fleet is not None:
            self._fleet.shutdown()
        # What is left belongs to a backend that never returned, or to an export a Ctrl-C cut short.
        shutil.rmtree(self.snapshot_root, ignore_errors=True)
        self._drained = self._take(self._latest_step)

    # ---------------------------------------------------------------------- API

    def due(self, step: int) -> bool:
        """Evaluate the weights produced by training ``step`` (0-based)? Every ``eval.every`` steps and the last."""
        return (step + 1) % self.cfg.every == 0 or step + 1 == self.config.run.num_steps

    def start(self, step: int) -> None:
        """Evaluate weight version ``step + 1``; call once those weights reached the rollout engines.

        Returns at once in the background modes (after the snapshot export for
        ``dedicated`` / ``external``); runs the whole evaluation for ``shared`` under
        ``schedule: sync``. Never raises for a failed evaluation.
        """
        if not self._open:
            raise RuntimeError("Evaluator.start() outside its with-block")
        self._latest_step = max(self._latest_step, step)
        now = time.monotonic()
        job = _Job(step=step, version=step + 1, started=now, deadline=now + self.cfg.timeout_s)
        with self._state:
            self._jobs = [j for j in self._jobs if not j.done.is_set()]
        try:
            if self.mode == "shared":
                self._start_shared(job)
            else:
                self._start_snapshot(job)
        except EvalSkipped as skip:
            self._finish(job, skip)
            job.done.set()
        except Exception as exc:  # never stop training for an evaluation
            log.exception("starting the evaluation of step %d failed", step)
            self._finish(job, EvalSkipped(ENGINE_ERROR, f"{type(exc).__name__}: {exc}"))
            remove_snapshot(job.snapshot)
            job.done.set()

    def collect(self, current_step: int) -> list[EvalResult]:
        """Results finished since the last call, oldest step first, with ``collected_at_step = current_step``.

        Each is appended to ``eval.jsonl`` here. After the with-block ends, the first call
        also returns what finished (or timed out) while it ended.
        """
        self._latest_step = max(self._latest_step, current_step)
        with self._state:
            drained, self._drained = self._drained, []
        return sorted(drained + self._take(current_step), key=lambda r: r.step)

    @property
    def outstanding(self) -> int:
        """Evaluations started whose work has not ended yet."""
        with self._state:
            return sum(not j.done.is_set() for j in self._jobs)

    # ------------------------------------------------------------------- shared

    def _start_shared(self, job: _Job) -> None:
        # Taken on the driver thread, so no weight update can slip in between start() and the evaluation.
        if not self._weights_lock.acquire(timeout=self.cfg.timeout_s):
            raise EvalSkipped(TIMEOUT, f"weights_lock was not free within {self.cfg.timeout_s:g} s")
        try:
            self._launch(job, self._run_shared, inline=self._inline)
        except BaseException:
            if not job.done.is_set():  # the worker never ran, so it will not release the lock
                self._weights_lock.release()
            raise

    def _run_shared(self, job: _Job) -> None:
        try:
            with self._pause():
                score = self._on_loop(job, self._score_shared(job.version))
        finally:
            self._weights_lock.release()
        self._finish_ok(job, score.metrics, score.versions)

    async def _score_shared(self, version: int) -> EvalScore:
        from miles.eval.versions import verify_engine_versions

        await verify_engine_versions(self._clients, version, what="rollout engine")
        score = await self.eval_set.score(self._clients, version)
        score.check(version)
        return score

    # ----------------------------------------------------------------- snapshots

    def _start_snapshot(self, job: _Job) -> None:
        running = self.outstanding
        if running >= self.cfg.max_outstanding:
            raise EvalSkipped(
                TOO_MANY_OUTSTANDING,
                f"{running} snapshot evaluation(s) still running (eval.max_outstanding = {self.cfg.max_outstanding});"
                " skipped without exporting",
            )
        t0 = time.perf_counter()
        job.snapshot = export_snapshot(self._export, self.snapshot_root, job.version)
        job.export_s = time.perf_counter() - t0
        run = self._run_dedicated if self.mode == "dedicated" else self._run_external
        self._launch(job, run, inline=False)

    def _run_dedicated(self, job: _Job) -> None:
        try:
            score = self._on_loop(job, self._score_dedicated(job))
        finally:
            remove_snapshot(job.snapshot)
        self._finish_ok(job, score.metrics, score.versions)

    async def _score_dedicated(self, job: _Job) -> EvalScore:
        from miles.eval.dedicated import load_snapshot

        if self._fleet_guard is None:
            self._fleet_guard = asyncio.Lock()  # created on the eval loop, which owns it
        async with self._fleet_guard:
            assert job.snapshot is not None
            await load_snapshot(self._clients, job.snapshot, job.version)
            score = await self.eval_set.score(self._clients, job.version)
        score.check(job.version)
        return score

    def _run_external(self, job: _Job) -> None:
        from miles.eval.external import backend_metrics
        from miles.interfaces import EvalRequest

        assert job.snapshot is not None and self._backend is not None
        ref = str(self.cfg.backend)
        request = EvalRequest(
            checkpoint_dir=job.snapshot,
            step=job.step,
            weight_version=job.version,
            options=dict(self.cfg.backend_options),
        )
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["value"] = self._backend.evaluate(request)  # type: ignore[union-attr]
            except BaseException as exc:
                outcome["error"] = exc

        # The backend is plugin code that may never return; it gets a thread so the timeout holds.
        thread = threading.Thread(target=call, name=f"miles-eval-backend-v{job.version}", daemon=True)
        try:
            thread.start()
            thread.join(max(0.0, job.deadline - time.monotonic()))
            if thread.is_alive():
                self._finish(
                    job, EvalSkipped(TIMEOUT, f"eval backend {ref!r} ran past {self.cfg.timeout_s:g} s")
                )
                thread.join()  # the snapshot stays until the backend lets go of it
                return
        finally:
            if not thread.is_alive():
                remove_snapshot(job.snapshot)
        if "error" in outcome:
            err = outcome["error"]
            raise EvalSkipped(BACKEND_ERROR, f"eval backend {ref!r} raised {type(err).__name__}: {err}")
        metrics, versions = backend_metrics(outcome.get("value"), ref)
        if versions is not None:
            try:
                versions.check(job.version)
            except EvalSkipped as skip:
                skip.metrics = metrics
                raise
        self._finish_ok(job, metrics, versions)

    # ------------------------------------------------------------------- plumbing

    def _launch(self, job: _Job, run: Callable[[_Job], None], *, inline: bool) -> None:
        with self._state:
            self._jobs.append(job)
        if inline:
            self._work(job, run)
        else:
            name = f"miles-eval-v{job.version}"
            threading.Thread(target=self._work, args=(job, run), name=name, daemon=True).start()

    def _work(self, job: _Job, run: Callable[[_Job], None]) -> None:
        try:
            run(job)
        except EvalSkipped as skip:
            self._finish(job, skip)
        except Exception as exc:
            from miles.errors import MilesError

            if not isinstance(exc, MilesError):
                log.exception("evaluation of step %d failed", job.step)
            self._finish(job, EvalSkipped(ENGINE_ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            job.done.set()

    def _on_loop(self, job: _Job, coro: Coroutine[Any, Any, EvalScore]) -> EvalScore:
        """Run ``coro`` on the eval loop within the job's deadline (cancelled, and skipped, past it)."""
        assert self._loop is not None
        timeout_s = self.cfg.timeout_s

        async def bounded() -> EvalScore:
            try:
                return await asyncio.wait_for(coro, max(0.0, job.deadline - time.monotonic()))
            except TimeoutError:
                raise EvalSkipped(TIMEOUT, f"still running after {timeout_s:g} s (eval.timeout_s)") from None

        job.future = self._loop.submit(bounded())
        try:
            return job.future.result()
        except concurrent.futures.CancelledError:
            raise EvalSkipped(
                TIMEOUT, "cancelled: the evaluator stopped before the evaluation finished"
            ) from None

    def _finish_ok(self, job: _Job, metrics: dict[str, float], versions: VersionStats | None) -> None:
        if job.export_s is not None:
            metrics = {**metrics, "export_s": job.export_s}
        self._publish(
            job,
            EvalResult(
                step=job.step,
                weight_version=job.version,
                mode=self.mode,
                status=OK,
                message="",
                metrics=metrics,
                mean_weight_version=None if versions is None else versions.mean_weight_version,
                mixed_version_fraction=None if versions is None else versions.mixed_version_fraction,
                seconds=time.monotonic() - job.started,
            ),
        )

    def _finish(self, job: _Job, skip: EvalSkipped) -> None:
        result = EvalResult(
            step=job.step,
            weight_version=job.version,
            mode=self.mode,
            status=SKIPPED,
            reason=skip.reason,
            message=skip.message,
            metrics=skip.metrics,
            mean_weight_version=skip.mean_weight_version,
            mixed_version_fraction=skip.mixed_version_fraction,
            seconds=time.monotonic() - job.started,
        )
        if self._publish(job, result):
            log.warning(
                "evaluation of step %d (weight version %d, mode %s) skipped: %s: %s",
                job.step,
                job.version,
                self.mode,
                skip.reason,
                skip.message,
            )

    def _publish(self, job: _Job, result: EvalResult) -> bool:
        with self._state:
            if job.result is not None:
                return False
            job.result = result
            self._finished.append(result)
            return True

    def _take(self, current_step: int) -> list[EvalResult]:
        with self._state:
            done, self._finished = self._finished, []
        for result in done:
            result.collected_at_step = current_step
            self._log.write(result)
        return done


def _own_copy(tokenizer: Any) -> Any:
    """A tokenizer of the evaluator's own: a fast tokenizer used from two threads at once can fail
    ("Already borrowed"), and under ``fully_async`` the rollout worker encodes at the same time."""
    import copy

    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # not copyable: share it (the synchronous schedule never encodes concurrently)
        return tokenizer
