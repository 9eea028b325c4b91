"""What ``train.lr_schedule`` means, for every training backend: warmup, then constant / linear / cosine.

The multiplier of optimizer step ``s`` (counting from 0, as ``LambdaLR`` does) is transformers'
schedule function ``f`` at ``s``, except during warmup, where it is ``f(s + 1)``: the first step
already trains at ``lr / warmup_steps`` (transformers' own warmup starts at 0, an optimizer step
that changes nothing), and the peak is reached at step ``warmup_steps - 1`` and held one step.
After warmup the decay is transformers' unchanged, spanning ``decay_steps`` optimizer steps in all
(warmup included), so the last step of a run of ``decay_steps`` steps still has a small positive
rate.

The constant schedule is its closed form, ``min(1, (s + 1) / warmup_steps)`` (exactly 1.0 on every
step without warmup), which is what transformers' ``constant_with_warmup`` gives under that
convention; it spares a rank process importing transformers. A backend applies the multiplier
through ``LambdaLR`` or by setting its optimizer's rate before each step; the numbers are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.config.schema import TrainSection
from miles.errors import ConfigError

# Our names -> transformers' SchedulerType values.
_HF_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def decay_steps(train: TrainSection, config: dict[str, Any] | None) -> int | None:
    """Optimizer steps the decay spans: ``train.lr_decay_steps``, else the run's (None for constant)."""
    if train.lr_schedule == "constant":
        return None
    if train.lr_decay_steps is not None:
        return train.lr_decay_steps
    num_steps = ((config or {}).get("run") or {}).get("num_steps")
    if num_steps is None:
        raise ConfigError(
            f"train.lr_schedule {train.lr_schedule!r} decays over the run, but this backend was started "
            "without a run config (no run.num_steps): set train.lr_decay_steps"
        )
    total = int(num_steps) * train.steps_per_rollout
    if total <= train.warmup_steps:
        raise ConfigError(
            f"train.warmup_steps ({train.warmup_steps}) leaves no optimizer step of the run's {total} "
            f"(run.num_steps x train.steps_per_rollout) to decay over; lower warmup_steps"
        )
    return total


def lr_multiplier(train: TrainSection, total_steps: int | None) -> Callable[[int], float]:
    """The factor on ``train.lr`` at optimizer step ``step`` (from 0; see the module docstring)."""
    warmup = train.warmup_steps
    if train.lr_schedule == "constant":
        return lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    import torch
    from transformers import get_scheduler

    name = _HF_NAMES[train.lr_schedule]
    kwargs: dict[str, Any] = {}
    if train.lr_schedule == "cosine" and train.min_lr_ratio > 0:
        name, kwargs = "cosine_with_min_lr", {"min_lr_rate": train.min_lr_ratio}
    # transformers builds its schedules on an optimizer; a throwaway one lends us the function alone.
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    f = get_scheduler(
        name,
        probe,
        num_warmup_steps=train.warmup_steps,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=kwargs or None,
    ).lr_lambdas[0]

    def multiplier(step: int) -> float:
        return float(f(step + 1 if step < warmup else step))

    return multiplier
