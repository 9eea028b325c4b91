"""Step timing for TRL's ``GRPOTrainer``, shared by the TRL comparisons.

``timed_grpo(sync)`` returns a callback that times each optimizer step and a ``GRPOTrainer``
subclass that times the rollout part of each step (generation, rewards, advantages), so a step
splits into rollout and train the way Miles' metrics split it. ``sync`` waits for the device
(``torch.cuda.synchronize`` on a GPU, a no-op on CPU) so that asynchronous kernels are counted in
the step that launched them. TRL is imported here, inside the worker process only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timed_grpo(sync: Callable[[], None]) -> tuple[Any, type]:
    """A fresh ``StepTimer`` callback and the ``TimedGRPOTrainer`` class (``rollout_s`` set per instance)."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.logs: list[dict[str, Any]] = []  # TRL's logged rows that carry a reward
            self.first_step_at: float | None = None
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self._t0 = time.perf_counter()
            if self.first_step_at is None:
                self.first_step_at = self._t0

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.step_s.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    class TimedGRPOTrainer(GRPOTrainer):
        """Records the rollout part of each step: generation, rewards and advantages."""

        rollout_s: list[float]

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rollout_s = []

        def _generate_and_score_completions(self, inputs):
            sync()
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            sync()
            self.rollout_s.append(time.perf_counter() - t0)
            return out

    return StepTimer(), TimedGRPOTrainer
