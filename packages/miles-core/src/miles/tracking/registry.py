"""Which trackers a run uses, the check that they can load, and their wiring into the run.

The recipe selects trackers by name: the switches ``tracking.jsonl`` / ``tensorboard`` /
``console`` (on by default) and the list ``tracking.backends`` (``[wandb, mlflow,
prometheus]``, any ``miles.trackers`` entry point or ``pkg.module:Class``). Each tracker's
options are ``tracking.options.<name>``, validated against its ``Options`` model with the
other component options (``miles.config.options``).

Every tracker is wrapped in a :class:`GuardedTracker`, the hook plugin the driver calls: a
tracker that raises is reported once and switched off, so a dead network connection or a
full disk on the tracking side never stops training nor costs each later step a timeout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import queue
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles import hookimpl
from miles.errors import ConfigError
from miles.tracking.base import Tracker, TrackerContext

if TYPE_CHECKING:
    from miles.config.schema import MilesConfig
    from miles.run_dir import RunDir

log = logging.getLogger("miles.tracking")

# The switches of the tracking section that select a tracker of the same name.
SWITCHES = ("jsonl", "tensorboard", "console")


def selected_trackers(config: MilesConfig) -> list[str]:
    """The tracker names this run uses, in the order they are called (no name twice)."""
    t = config.tracking
    names = [name for name in SWITCHES if getattr(t, name)]
    for name in t.backends:
        if name not in names:
            names.append(name)
    return names


def tracker_class(name: str) -> Any:
    from miles.plugins import load_component

    return load_component("tracker", name)


def check_trackers(config: MilesConfig) -> None:
    """Every selected tracker loads and has its library: else one line saying what to install.
    Options for a tracker the run does not use are refused (a typo in a name would otherwise
    silently drop them)."""
    selected = selected_trackers(config)
    unused = sorted(set(config.tracking.options) - set(selected))
    if unused:
        raise ConfigError(
            f"tracking.options has options for {unused}, which the run does not use (trackers: {selected}); "
            "add them to tracking.backends or remove their options"
        )
    for name in selected:
        cls = tracker_class(name)
        missing = [m for m in getattr(cls, "requires", ()) if importlib.util.find_spec(m) is None]
        if missing:
            install = getattr(cls, "install", "") or " ".join(missing)
            raise ConfigError(
                f"tracker {name!r} needs {', '.join(missing)}, which is not installed: "
                f"pip install '{install}' (or drop it from the tracking section)"
            )


class GuardedTracker:
    """The hook plugin around one tracker: forwards the run's metrics, and contains its failures.

    A tracker whose class sets ``background = True`` (one that talks to a service or a disk:
    W&B, MLflow, TensorBoard, Prometheus) is called from a thread of its own, in order, so a slow
    tracking server never lengthens a step. Its queue is bounded: a tracker that falls that far
    behind loses rows (warned once) rather than holding memory or the run. ``close`` waits for
    the queue to drain.
    """

    QUEUE = 1000
    CLOSE_TIMEOUT_S = 120.0

    def __init__(self, name: str, tracker: Tracker) -> None:
        self.name = name
        self.tracker = tracker
        self.failed = False
        self.status = "failed"  # what close() reports unless the run says otherwise
        self._dropped = False
        self._queue: queue.Queue[tuple[str, Any, tuple[Any, ...]] | None] | None = None
        self._thread: threading.Thread | None = None
        if getattr(type(tracker), "background", False):
            self._queue = queue.Queue(maxsize=self.QUEUE)
            self._thread = threading.Thread(target=self._drain, name=f"miles-tracker-{name}", daemon=True)
            self._thread.start()

    def _call(self, what: str, fn: Any, *args: Any, always: bool = False) -> None:
        if self.failed and not always:
            return
        try:
            fn(*args)
        except Exception as exc:
            if self.failed:  # already reported: its close failing too is no news
                return
            self.failed = True
            log.warning(
                "tracker %r failed in %s (%s: %s); it is switched off for the rest of the run",
                self.name,
                what,
                type(exc).__name__,
                exc,
            )

    def _submit(self, what: str, fn: Any, *args: Any) -> None:
        if self._queue is None:
            self._call(what, fn, *args)
            return
        try:
            self._queue.put_nowait((what, fn, args))
        except queue.Full:
            if not self._dropped:
                self._dropped = True
                log.warning(
                    "tracker %r is %d calls behind; dropping its rows until it catches up",
                    self.name,
                    self.QUEUE,
                )

    def _drain(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            self._call(item[0], item[1], *item[2])

    @hookimpl
    def miles_on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        # A copy: the driver may keep using its dict while the tracker's thread reads this one.
        self._submit("log", self.tracker.log, step, dict(metrics))

    @hookimpl
    def miles_on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._submit("log_eval", self.tracker.log_eval, step, dict(metrics))

    @hookimpl
    def miles_on_run_end(self, run_dir: str, status: str) -> None:
        self.status = status

    def close(self) -> None:
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)  # blocks only while the queue is full: the tracker is draining it
            self._thread.join(self.CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning(
                    "tracker %r did not finish within %.0f s; closing it anyway",
                    self.name,
                    self.CLOSE_TIMEOUT_S,
                )
        # Closed even after a failure: it may hold a port, a file or a remote run open.
        self._call("close", self.tracker.close, self.status, always=True)


def context_for(config: MilesConfig, run_dir: str, first_step: int) -> TrackerContext:
    return TrackerContext(
        run_dir=run_dir,
        run_name=config.run.name,
        num_steps=config.run.num_steps,
        first_step=first_step,
        config=config.model_dump(mode="json"),
        log_samples=config.tracking.log_samples,
    )


def build_tracker(name: str, ctx: TrackerContext, options: Mapping[str, Any]) -> Tracker:
    cls = tracker_class(name)
    model = getattr(cls, "Options", None)
    opts = model.model_validate(dict(options)) if model is not None else dict(options)
    tracker = cls(ctx, opts)
    if not isinstance(tracker, Tracker):
        raise ConfigError(f"tracker {name!r} ({cls!r}) does not implement log / log_eval / close")
    return tracker


def start_trackers(
    config: MilesConfig, run: RunDir, first_step: int, pm: Any, stack: contextlib.ExitStack
) -> dict[str, Tracker]:
    """Build the selected trackers and register each (guarded) with the plugin manager until the
    run closes; also the rollout dumper when ``rollout.dump`` is on. Returns the trackers by name."""
    ctx = context_for(config, run.path, first_step)
    trackers: dict[str, Tracker] = {}
    for name in selected_trackers(config):
        tracker = build_tracker(name, ctx, config.tracking.options.get(name, {}))
        trackers[name] = tracker
        guarded = GuardedTracker(name, tracker)
        pm.register(guarded, name=f"tracker:{name}")
        stack.callback(guarded.close)
        stack.callback(pm.unregister, guarded)
    if config.rollout.dump:
        from miles.tracking.dumps import RolloutDumper

        dumper = RolloutDumper(run.path)
        pm.register(dumper, name="rollout-dumper")
        stack.callback(dumper.close)
        stack.callback(pm.unregister, dumper)
    return trackers
