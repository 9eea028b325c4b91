"""Metrics as TensorBoard event files (needs the ``tracking`` extra)."""

from __future__ import annotations

from miles import hookimpl
from miles.errors import ConfigError


class TensorBoardTracker:
    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard itself is missing
            raise ConfigError(
                "tracking.tensorboard is on but the tensorboard package is not installed; "
                "install miles-core[tracking] or set tracking.tensorboard=false"
            ) from exc
        self.log_dir = log_dir
        # A resumed run redoes the steps after its checkpoint: purge_step tells TensorBoard to drop
        # the earlier attempt's events from that step on, so no step appears twice.
        self._writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    @hookimpl
    def miles_on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    @hookimpl
    def miles_on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.miles_on_metrics(step, metrics)  # plotted at the step it measured, whenever it arrived

    def close(self) -> None:
        self._writer.close()
