"""Metrics as one JSON object per step, appended and flushed as each step ends."""

from __future__ import annotations

import json
import math
import os

from miles import hookimpl


class JsonlTracker:
    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    @hookimpl
    def miles_on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        row = {
            "step": step,
            **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()},
        }
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
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
