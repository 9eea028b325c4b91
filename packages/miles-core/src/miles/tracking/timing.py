"""Where a step's time goes: one clock per step, named phases, and the end-of-run table.

The driver opens a :class:`StepClock` around each step (:func:`step_clock`); code anywhere
below it marks a phase with ``with timed("score"): ...``, without the clock being passed
down. Phases are *exclusive*: a phase opened inside another is counted once, in the inner
one, so the named phases of a step add up to at most its wall time and ``time/other_s`` is
the remainder nobody named. A phase marked on another thread (the fully asynchronous
rollout worker, an evaluation's thread) is not part of the step and is not recorded: the
clock lives in a context variable, which a new thread does not inherit.

Work that runs *concurrently* inside a phase (reward calls interleaved with generation) is
recorded with :func:`add_busy` as busy time, shown under its phase and never added to the
sum: it can exceed the phase's wall time.

Metric names: ``time/<phase>_s`` for phases, ``time/<phase>/<part>_s`` for parts of a phase
that its component reports itself (the trainer's forward+backward and optimizer time, the
rollout's reward calls), ``time/step_s`` for the whole step and ``time/other_s`` for the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

_CLOCK: contextvars.ContextVar[StepClock | None] = contextvars.ContextVar("miles_step_clock", default=None)

# Phases in the order a step runs them (the table keeps this order; unknown phases follow).
PHASE_ORDER = (
    "data",
    "offload",
    "rollout",
    "onload",
    "score",
    "advantages",
    "train_step",
    "checkpoint",
    "weight_update",
    "eval",
)


@dataclass
class _Open:
    name: str
    start: float
    inner: float = 0.0  # time spent in phases opened inside this one


@dataclass
class StepClock:
    """Exclusive wall time per phase within one step (see the module docstring)."""

    totals: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)
    _stack: list[_Open] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        entry = _Open(name, time.perf_counter())
        self._stack.append(entry)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - entry.start
            self._stack.pop()
            self.totals[name] = self.totals.get(name, 0.0) + elapsed - entry.inner
            if self._stack:
                self._stack[-1].inner += elapsed

    def add_busy(self, name: str, seconds: float) -> None:
        self.busy[name] = self.busy.get(name, 0.0) + seconds

    def metrics(self, step_s: float) -> dict[str, float]:
        """``time/`` metrics of the phases that ran, the busy times, and the unnamed remainder."""
        out = {f"time/{name}_s": seconds for name, seconds in self.totals.items()}
        out |= {f"time/{name}_s": seconds for name, seconds in self.busy.items()}
        out["time/other_s"] = max(step_s - sum(self.totals.values()), 0.0)
        return out


@contextlib.contextmanager
def step_clock() -> Iterator[StepClock]:
    """The clock that ``timed`` phases below this point (on this thread) report to."""
    clock = StepClock()
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)


def timed(name: str) -> contextlib.AbstractContextManager[None]:
    """Count what runs inside as phase ``name`` of the current step (nothing outside a step)."""
    clock = _CLOCK.get()
    return contextlib.nullcontext() if clock is None else clock.phase(name)


def add_busy(name: str, seconds: float) -> None:
    """Add ``seconds`` of concurrent work to ``time/<name>_s`` of the current step, if any."""
    clock = _CLOCK.get()
    if clock is not None:
        clock.add_busy(name, seconds)


# ---------------------------------------------------------------- the run's summary


@dataclass
class TimeBreakdown:
    """Sums of every step's ``time/`` metrics, and the table of where the run's time went."""

    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    @classmethod
    def from_jsonl(cls, path: str) -> TimeBreakdown:
        """The breakdown of a run's ``metrics.jsonl`` (one row per step)."""
        import json

        out = cls()
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    out.add(json.loads(line))
        return out

    def add(self, metrics: Mapping[str, float]) -> None:
        if "time/step_s" not in metrics:
            return
        self.steps += 1
        for key, value in metrics.items():
            if key.startswith("time/") and key.endswith("_s"):
                self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def rows(self) -> list[tuple[str, float, float, float]]:
        """``(phase, total s, mean s per step, share of step time)``; parts are indented under
        their phase; phases that add up to the step come first, in step order, then ``other``."""
        total = self.sums.get("time/step_s", 0.0)
        names = {key[len("time/") : -len("_s")] for key in self.sums} - {"step"}
        top = [n for n in names if "/" not in n and n != "other"]
        top.sort(key=lambda n: (PHASE_ORDER.index(n) if n in PHASE_ORDER else len(PHASE_ORDER), n))
        parents = {n.split("/", 1)[0] for n in names if "/" in n}
        # A part whose phase was not timed as such (e.g. a backend's own parts) still shows, last.
        ordered: list[str] = []
        for name in [*top, *sorted(parents - set(top))]:
            if name in top:
                ordered.append(name)
            ordered.extend(sorted(n for n in names if n.startswith(name + "/")))
        if "other" in names:
            ordered.append("other")
        out = []
        for name in ordered:
            seconds = self.sums[f"time/{name}_s"]
            label = "  " + name.split("/", 1)[1] if "/" in name else name
            out.append((label, seconds, seconds / max(self.steps, 1), seconds / total if total > 0 else 0.0))
        out.append(("step", total, total / max(self.steps, 1), 1.0 if total > 0 else 0.0))
        return out

    def text(self) -> str:
        """The table as plain text (for logs and files)."""
        lines = [f"{'phase':<28}{'total s':>10}{'s/step':>10}{'share':>8}"]
        for label, seconds, mean, share in self.rows():
            lines.append(f"{label:<28}{seconds:>10.2f}{mean:>10.3f}{share:>8.1%}")
        return "\n".join(lines)
