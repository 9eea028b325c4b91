"""Metrics as TensorBoard event files under ``tensorboard/`` (needs the ``tracking`` extra)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar

from miles.tracking.base import NoOptions, TrackerContext


class TensorBoardTracker:
    Options = NoOptions
    requires: ClassVar[tuple[str, ...]] = ("tensorboard",)
    install: ClassVar[str] = "miles-core[tracking]"
    background: ClassVar[bool] = True  # called from its own thread (miles.tracking.registry)

    def __init__(self, ctx: TrackerContext, options: NoOptions | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(ctx.run_dir, "tensorboard")
        # A resumed run redoes the steps after its checkpoint: purge_step tells TensorBoard to drop
        # the earlier attempt's events from that step on, so no step appears twice.
        # flush_secs: events reach the file within 10 s without a flush per step (which cost ~8 ms).
        self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=ctx.first_step or None, flush_secs=10)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float):
                self._writer.add_scalar(key, value, global_step=step)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log(step, metrics)  # plotted at the step it measured, whenever it arrived

    def close(self, status: str) -> None:
        self._writer.close()
