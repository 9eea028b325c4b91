"""What a run leaves beside its metrics when it ends: the time table and the learning curves."""

from __future__ import annotations

import logging
import os

from miles.config.schema import MilesConfig
from miles.tracking.curves import CURVES_FILE, matplotlib_available, write_curves
from miles.tracking.timing import TimeBreakdown

log = logging.getLogger("miles.tracking")

BREAKDOWN_FILE = "time_breakdown.txt"


def write_run_summaries(config: MilesConfig, run_path: str) -> None:
    """``time_breakdown.txt`` (where the time went) and, per ``tracking.plot``, ``reward_curve.png``."""
    metrics_path = os.path.join(run_path, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        return
    breakdown = TimeBreakdown.from_jsonl(metrics_path)
    if breakdown.steps:
        with open(os.path.join(run_path, BREAKDOWN_FILE), "w", encoding="utf-8") as f:
            f.write(breakdown.text() + "\n")
    plot = config.tracking.plot
    if plot is False:
        return
    if plot is None and not matplotlib_available():
        log.info("no %s: matplotlib is not installed (pip install matplotlib)", CURVES_FILE)
        return
    # The pre-flight refused plot: true without matplotlib, so here it imports.
    write_curves(
        metrics_path, os.path.join(run_path, CURVES_FILE), title=f"{config.run.name}: learning curves"
    )


def check_plot_requirements(config: MilesConfig) -> None:
    """``tracking.plot: true`` needs matplotlib: say so before the run starts, not after it ends."""
    from miles.errors import ConfigError

    if config.tracking.plot is True and not matplotlib_available():
        raise ConfigError(
            "tracking.plot is true, but matplotlib is not installed; install it (pip install matplotlib) "
            "or set tracking.plot to null (draw when installed) or false"
        )
