"""On-policy distillation: a teacher's per-token reverse-KL estimate folded into the advantages.

The student samples; a teacher scores the student's own tokens. At every loss token,
``rkl_t = log π_student(x_t) − log π_teacher(x_t)`` is a one-sample estimate of the reverse
KL ``KL(π_student ‖ π_teacher)`` at that position: positive where the student favoured the
token more than the teacher would. Subtracting ``coef·rkl_t`` from the advantage turns it
into a dense per-token reward, so distillation composes with any estimator: it runs after
the estimator, on its output (after its whitening, when it whitens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles.builtins.algorithms.kl import LOG_RATIO_LIMIT, kl_estimate
from miles.builtins.algorithms.tokens import TokenBatch, sample_name
from miles.builtins.algorithms.whiten import masked_mean_std
from miles.interfaces import OPD_REVERSE_KL, TEACHER_LOGPROBS
from miles.types import Sample

# A served teacher's top-K estimate, computed at rollout time: per token, a weighted sum of
# log π_student − log π_teacher over a candidate set of tokens instead of the sampled one.


def fold_reverse_kl(
    samples: Sequence[Sample], advantages: Sequence[Sequence[float]], coef: float
) -> tuple[list[list[float]], dict[str, float]]:
    """``A_t − coef·rkl_t`` on each sample's loss tokens, 0 elsewhere, as new lists (inputs untouched).

    Per sample, ``rkl_t`` is ``token_scores["opd_reverse_kl"][t]`` when present (a top-K
    estimate), else ``rollout_logprobs[t] − token_scores["teacher_logprobs"][t]`` (the
    student's log-probs as the engine recorded them when sampling). Either is sanitized like
    ``kl.kl_estimate``: clamped to ±20 nats, ``±inf`` saturating at the bound and ``nan``
    counting as 0, so a teacher that rules a token out (log-prob ``−inf``) gives a large,
    finite penalty.

    Raises ValueError for a sample with neither score or with a row whose length is not its
    response's (naming the sample's prompt index and what is wrong), and for a bad ``coef``.

    Metrics: ``distill/reverse_kl``, the mean ``rkl_t`` over all loss tokens before scaling;
    ``distill/teacher_logprob_mean``, the mean finite teacher log-prob over the loss tokens of
    the samples that carry ``teacher_logprobs`` (only when some do).
    """
    import torch

    if isinstance(coef, bool) or not isinstance(coef, int | float) or not (math.isfinite(coef) and coef >= 0):
        raise ValueError(f"distillation: coef must be a finite number >= 0, got {coef!r}")
    if len(advantages) != len(samples):
        raise ValueError(f"distillation: {len(advantages)} advantage rows for {len(samples)} samples")
    batch = TokenBatch.from_samples(samples, who="distillation")
    folded = batch.pad(advantages, "advantages")

    precomputed = [s.token_scores.get(OPD_REVERSE_KL) for s in samples]
    teacher_rows = [s.token_scores.get(TEACHER_LOGPROBS) for s in samples]
    for sample, pre, teacher_row in zip(samples, precomputed, teacher_rows, strict=True):
        if pre is None and teacher_row is None:
            raise ValueError(
                f"distillation: {sample_name(sample)} has neither token_scores[{OPD_REVERSE_KL!r}] (a served "
                f"teacher's top-K estimate) nor token_scores[{TEACHER_LOGPROBS!r}] (the teacher's log-probs "
                "of the sampled tokens); did the teacher score it?"
            )
    use_teacher = [pre is None for pre in precomputed]
    teacher = batch.pad(teacher_rows, f"token_scores[{TEACHER_LOGPROBS!r}]")
    student = batch.pad(
        [s.rollout_logprobs if t else None for s, t in zip(samples, use_teacher, strict=True)],
        "rollout_logprobs",
    )
    from_teacher = kl_estimate(student, teacher, "k1")  # log π_s − log π_t, sanitized and clamped
    given = batch.pad(precomputed, f"token_scores[{OPD_REVERSE_KL!r}]")
    given = torch.nan_to_num(given, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)
    given = given.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    rows_from_teacher = torch.tensor(use_teacher, dtype=torch.bool).reshape(-1, 1)
    reverse_kl = torch.where(batch.mask, torch.where(rows_from_teacher, from_teacher, given), 0.0)

    folded = folded - coef * reverse_kl
    metrics = {"distill/reverse_kl": masked_mean_std(reverse_kl, batch.mask)[0]}
    has_teacher = torch.tensor([t is not None for t in teacher_rows], dtype=torch.bool).reshape(-1, 1)
    if bool(has_teacher.any()):
        counted = batch.mask & has_teacher & torch.isfinite(teacher)
        metrics["distill/teacher_logprob_mean"] = masked_mean_std(teacher, counted)[0]
    return batch.rows(folded), metrics
