"""What one evaluation produced, and the ``eval.jsonl`` record of it.

A result is always recorded against the training step whose weights it measured
(weights of version ``v`` are the policy after step ``v - 1``), never against the step
at which it happened to finish; how late it arrived is ``delay_steps``.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

OK = "ok"
SKIPPED = "skipped"

# Why an evaluation was skipped. Training never stops for any of them.
EXPORT_FAILED = "export_failed"  # the snapshot export raised
MISSING_SNAPSHOT = "missing_snapshot"  # the export returned but left no Hugging Face checkpoint
TOO_MANY_OUTSTANDING = "too_many_outstanding"  # eval.max_outstanding snapshot evaluations still running
BACKEND_ERROR = "backend_error"  # the external backend raised or returned something that is not metrics
VERSION_MISMATCH = "version_mismatch"  # an engine or an eval token was not on the expected weight version
TIMEOUT = "timeout"  # ran past eval.timeout_s (or was still running when the run ended)
ENGINE_ERROR = "engine_error"  # an engine failed to load the snapshot, to answer, or aborted eval requests
SKIP_REASONS = (
    EXPORT_FAILED,
    MISSING_SNAPSHOT,
    TOO_MANY_OUTSTANDING,
    BACKEND_ERROR,
    VERSION_MISMATCH,
    TIMEOUT,
    ENGINE_ERROR,
)


class EvalSkipped(Exception):
    """Raised inside an evaluation to end it as skipped; carries what was measured before it stopped."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        metrics: dict[str, float] | None = None,
        mean_weight_version: float | None = None,
        mixed_version_fraction: float | None = None,
    ) -> None:
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; one of {SKIP_REASONS}")
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.metrics = dict(metrics or {})
        self.mean_weight_version = mean_weight_version
        self.mixed_version_fraction = mixed_version_fraction


@dataclass
class EvalResult:
    """One evaluation of the weights of version ``weight_version`` (= the policy after training ``step``)."""

    step: int
    weight_version: int
    mode: str  # "shared" | "dedicated" | "external"
    status: str  # "ok" | "skipped"
    reason: str | None = None  # one of SKIP_REASONS when skipped
    message: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # score (mean reward), pass_rate, n_samples...
    mean_weight_version: float | None = None  # over every eval token
    mixed_version_fraction: float | None = None  # eval samples with a token off the expected version
    collected_at_step: int | None = None  # the driver's step when collect() handed it over
    seconds: float = 0.0  # from start() to the result

    @property
    def skipped(self) -> bool:
        return self.status == SKIPPED

    @property
    def delay_steps(self) -> int | None:
        """How many training steps after the measured one the result reached the driver."""
        return None if self.collected_at_step is None else self.collected_at_step - self.step

    def as_metrics(self) -> dict[str, float]:
        """Tracker metrics under ``eval/``: the scores plus the bookkeeping that says what they measured."""
        out: dict[str, float] = {
            "eval/step": float(self.step),
            "eval/weight_version": float(self.weight_version),
            "eval/skipped": 1.0 if self.skipped else 0.0,
            "eval/seconds": float(self.seconds),
        }
        if self.delay_steps is not None:
            out["eval/delay_steps"] = float(self.delay_steps)
        if self.mean_weight_version is not None:
            out["eval/mean_weight_version"] = float(self.mean_weight_version)
        if self.mixed_version_fraction is not None:
            out["eval/mixed_version_fraction"] = float(self.mixed_version_fraction)
        if not self.skipped:  # a skipped evaluation's partial numbers would read as a score
            out.update({f"eval/{name}": float(value) for name, value in self.metrics.items()})
        return out

    def record(self) -> dict[str, Any]:
        """The ``eval.jsonl`` row (non-finite numbers become null, so every row is valid JSON)."""
        return {
            "step": self.step,
            "weight_version": self.weight_version,
            "mode": self.mode,
            "status": self.status,
            "reason": self.reason,
            "message": self.message,
            "delay_steps": self.delay_steps,
            "collected_at_step": self.collected_at_step,
            "metrics": {name: _finite(value) for name, value in self.metrics.items()},
            "mean_weight_version": _finite(self.mean_weight_version),
            "mixed_version_fraction": _finite(self.mixed_version_fraction),
            "seconds": _finite(self.seconds),
        }


def _finite(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class EvalLog:
    """Appends one JSON object per evaluation to ``run_dir/eval.jsonl``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, result: EvalResult) -> None:
        line = json.dumps(result.record(), allow_nan=False, sort_keys=False)
        with self._lock:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
