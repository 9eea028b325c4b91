"""Hook implementations that ship with miles-core, registered like any plugin's.

The built-in trackers and the backend adapter are registered per run by the driver
(they need the run's paths); this module holds the hooks that need no run state.
"""

from __future__ import annotations

import time
from collections.abc import Generator

from miles import hookimpl
from miles.types import TrainBatch


@hookimpl(wrapper=True)
def miles_train_step(step: int, batch: TrainBatch) -> Generator[None, dict[str, float], dict[str, float]]:
    """Time every training step, whichever backend runs it."""
    t0 = time.perf_counter()
    metrics = yield
    return {**(metrics or {}), "time/train_step_s": time.perf_counter() - t0}
