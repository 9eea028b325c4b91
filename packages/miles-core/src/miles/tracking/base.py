"""The tracker contract: what every metrics sink (built-in or third-party) implements.

A tracker is a class registered in the ``miles.trackers`` entry-point group (or named by an
import path in ``tracking.backends``). The run builds it as ``cls(ctx, options)`` where
``options`` is an instance of the class's ``Options`` model (validated from
``tracking.options.<name>`` before the run starts) and calls the three methods below, in
order, from one thread: the driver's, or one of the tracker's own when the class sets
``background = True`` (for trackers that wait on a service or a disk). ``requires`` names
the modules it imports and ``install`` the requirement that provides them, so a missing
library is refused at validation with one line saying what to install, before any engine
starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from miles.capabilities import ComponentOptions


class NoOptions(ComponentOptions):
    """A tracker without options (any key under its ``tracking.options`` entry is refused)."""


@dataclass(frozen=True)
class TrackerContext:
    """What a tracker may know about the run when it is built."""

    run_dir: str
    run_name: str
    num_steps: int
    first_step: int  # > 0: a resumed run, which redoes the steps from here
    config: Mapping[str, Any] = field(default_factory=dict)  # the validated recipe, as plain data
    log_samples: int = 1


@runtime_checkable
class Tracker(Protocol):
    """One metrics sink. Exceptions are caught by the run (warned once, the tracker switched off)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """The metrics of one finished step."""

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """An evaluation of the weights of ``step`` (it may arrive steps later)."""

    def close(self, status: str) -> None:
        """The run ended: ``completed``, ``failed`` or ``interrupted``. Called once."""


class TrackerClass(Protocol):
    """What the entry point names: a class with the attributes below, called as ``cls(ctx, options)``."""

    Options: ClassVar[type[ComponentOptions]]
    requires: ClassVar[tuple[str, ...]]
    install: ClassVar[str]

    def __call__(self, ctx: TrackerContext, options: Any) -> Tracker: ...


def finite_scalars(metrics: Mapping[str, object]) -> dict[str, float]:
    """The numeric, finite values of ``metrics`` as floats: what a typed store (MLflow, Prometheus) takes."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        v = float(value)
        if v == v and v not in (float("inf"), float("-inf")):
            out[key] = v
    return out


def read_run_id(path: str) -> str | None:
    """The remote run id a tracker stored in the run directory (None: a new run)."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def write_run_id(path: str, value: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    os.replace(tmp, path)
