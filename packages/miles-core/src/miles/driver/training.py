"""The training stage: advantages over the kept groups, then one backend step."""

from __future__ import annotations

from typing import Any

from miles.interfaces import AdvantageEstimator
from miles.types import Group, TrainBatch


def make_train_batch(groups: list[Group], advantage: AdvantageEstimator, step: int, hooks: Any) -> TrainBatch:
    samples = [s for g in groups for s in g.samples]
    advantages = advantage(groups)
    if len(advantages) != len(samples):
        raise RuntimeError(f"advantage estimator returned {len(advantages)} rows for {len(samples)} samples")
    batch = TrainBatch(samples=samples, advantages=advantages, step=step)
    hooks.miles_advantages_postprocess(batch=batch)
    return batch
