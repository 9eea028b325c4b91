"""The run's learning curves as one PNG beside its metrics (``reward_curve.png``).

Drawn from ``metrics.jsonl`` when the run ends: the mean rollout reward per step, the fraction of
samples with full reward (for an exact-answer task: the exact answers at the sampling
temperature), and every evaluation's pass rate when the recipe evaluates. matplotlib is imported
here only (it is slow to import and not every install has it): ``tracking.plot`` decides whether a
missing matplotlib is an error (``true``) or one log line (``null``, the default).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("miles.tracking")

CURVES_FILE = "reward_curve.png"

# Metric name -> the legend's words. Only the ones a run logged are drawn.
STEP_SERIES = {
    "rollout/reward_mean": "mean reward (rollout)",
    "rollout/full_reward_frac": "full-reward fraction (rollout)",
}
EVAL_SUFFIX = "/pass_rate"  # eval/<name>/pass_rate, one point per evaluation


@dataclass
class Curves:
    """Series read from a metrics file: name -> (steps, values)."""

    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    @classmethod
    def from_rows(
        cls, rows: Iterable[dict[str, object]], keep: Callable[[str], bool] | None = None
    ) -> Curves:
        """The series of the metrics ``keep`` accepts (default: the reward curves drawn here)."""
        keep = keep or _reward_curve
        curves = cls()
        for row in rows:
            step = row.get("step")
            if not isinstance(step, int):
                continue
            for name, value in row.items():
                if not isinstance(value, int | float) or isinstance(value, bool):
                    continue
                if keep(name):
                    steps, values = curves.series.setdefault(name, ([], []))
                    steps.append(step)
                    values.append(float(value))
        return curves

    @classmethod
    def from_jsonl(cls, path: str, keep: Callable[[str], bool] | None = None) -> Curves:
        return cls.from_rows(read_rows(path), keep)

    def names(self) -> Sequence[str]:
        return sorted(self.series)


def _reward_curve(name: str) -> bool:
    return name in STEP_SERIES or (name.startswith("eval/") and name.endswith(EVAL_SUFFIX))


def read_rows(path: str) -> list[dict[str, object]]:
    """The rows of a metrics file. A running run may be mid-write: a last line without its newline
    (or one that does not parse) is left for the next read."""
    rows: list[dict[str, object]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_curves(metrics_path: str, out_path: str, *, title: str) -> bool:
    """Draw the run's curves into ``out_path``; False when there was nothing to draw."""
    if not os.path.isfile(metrics_path):
        return False
    curves = Curves.from_jsonl(metrics_path)
    if not curves.series:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window, never need a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    try:
        for name in curves.names():
            steps, values = curves.series[name]
            label = (
                STEP_SERIES.get(name) or f"pass rate ({name.removeprefix('eval/').removesuffix(EVAL_SUFFIX)})"
            )
            style = "o-" if name.startswith("eval/") else "-"
            ax.plot(steps, values, style, label=label, markersize=3, linewidth=1.4)
        ax.set_xlabel("training step")
        ax.set_ylabel("reward / fraction")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        tmp = out_path + ".tmp"
        fig.savefig(tmp, format="png")
        os.replace(tmp, out_path)  # a reader never sees half a file
    finally:
        plt.close(fig)
    return True
