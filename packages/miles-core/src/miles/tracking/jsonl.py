"""Metrics as one JSON object per step in ``metrics.jsonl``, appended and flushed as each step ends.

The file is the run's record: ``miles report``, the time table and the resume logic read it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import ClassVar

from miles.tracking.base import NoOptions, TrackerContext

METRICS_FILE = "metrics.jsonl"


class JsonlTracker:
    Options = NoOptions
    requires: ClassVar[tuple[str, ...]] = ()
    install: ClassVar[str] = ""

    def __init__(self, ctx: TrackerContext, options: NoOptions | None = None) -> None:
        self.path = os.path.join(ctx.run_dir, METRICS_FILE)
        os.makedirs(ctx.run_dir, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {
            "step": step,
            **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()},
        }
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Evaluations have their own file (``eval.jsonl``, written by the evaluator)."""

    def close(self, status: str) -> None:
        self._file.close()


def truncate_after(path: str, last_step: int) -> int:
    """Drop rows for steps after ``last_step`` (a resumed run redoes them). Returns rows dropped."""
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", -1) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(rows) - len(kept)
