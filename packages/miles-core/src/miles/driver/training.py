"""The training stage: per-token scores, advantages (+ distillation), then one backend step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.driver.objective import Objective
from miles.errors import ComponentError
from miles.interfaces import AdvantageOutput, Backend
from miles.tracking.timing import timed
from miles.types import Group, TrainBatch

if TYPE_CHECKING:
    from miles.driver.hooks import Hooks


def make_train_batch(
    groups: list[Group], objective: Objective, backend: Backend, step: int, hooks: Hooks
) -> tuple[TrainBatch, dict[str, float]]:
    """Score the kept groups on the trainer if the objective needs it, then turn them into a batch.

    Order matters and follows the report: the estimator runs on the (possibly zeroed) task
    rewards, then the teacher's reverse-KL estimate is subtracted from its advantages, so
    distillation composes with every estimator.
    """
    samples = [s for g in groups for s in g.samples]
    if objective.scores:
        with timed("score"):  # forward-only passes: reference, teacher, critic
            scores = backend.score(samples, list(objective.scores))
        for name, rows in scores.items():
            for sample, row in zip(samples, rows, strict=True):
                sample.token_scores[name] = row
    distill = objective.distillation
    if distill is not None and distill.task_reward == "zero":
        for sample in samples:
            sample.metadata.setdefault("task_reward", sample.reward)
            sample.reward = 0.0

    assert objective.advantage is not None
    out = objective.advantage(groups)
    if not isinstance(out, AdvantageOutput):
        raise ComponentError(
            f"advantage estimator returned {type(out).__name__}; it must return miles.interfaces.AdvantageOutput"
        )
    if len(out.advantages) != len(samples):
        raise ComponentError(
            f"advantage estimator returned {len(out.advantages)} rows for {len(samples)} samples"
        )
    metrics = dict(out.metrics)
    advantages = out.advantages
    if distill is not None:
        from miles.builtins.algorithms.opd import fold_reverse_kl

        advantages, distill_metrics = fold_reverse_kl(samples, advantages, distill.coef)
        metrics |= distill_metrics
    batch = TrainBatch(samples=samples, advantages=advantages, step=step, returns=out.returns)
    hooks.miles_advantages_postprocess(batch=batch)
    return batch, metrics
