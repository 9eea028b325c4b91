"""The top-K reverse-KL estimate of on-policy distillation (pure functions, no torch).

At one position the reverse KL is ``KL(π_s ‖ π_t) = Σ_x π_s(x)·(log π_s(x) − log π_t(x))``
over the whole vocabulary. The sampled token ``x_t`` alone gives the one-sample estimate
``log π_s(x_t) − log π_t(x_t)``. The top-K estimate sums over a candidate set ``C``
instead, with the student's probabilities renormalised on ``C``::

    w_k      = exp(log π_s(k)) / Σ_{j∈C} exp(log π_s(j))      (softmax of the student's log-probs on C)
    estimate = Σ_{k∈C} w_k · (log π_s(k) − log π_t(k))

Candidate sets (``candidates``):

- ``"student"``: the student's top-K ids at that position (the teacher must report its
  log-probs on exactly those ids);
- ``"intersection"``: the student's top-K ids that are also in the teacher's top-K.

An empty candidate set (a disjoint intersection) falls back to the one-sample estimate.
All log-probs are natural logs, taken at the same temperature for both models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Candidates = Literal["student", "intersection"]
CANDIDATES: tuple[str, ...] = ("student", "intersection")


def reverse_kl_at(
    student_ids: Sequence[int],
    student_logprobs: Sequence[float],
    teacher_ids: Sequence[int],
    teacher_logprobs: Sequence[float],
    *,
    candidates: Candidates,
    sampled_student: float,
    sampled_teacher: float,
) -> float:
    """The top-K reverse-KL estimate at one position (see the module docstring).

    ``student_ids`` / ``student_logprobs``: the student's top-K ids and their log-probs.
    ``teacher_ids`` / ``teacher_logprobs``: ids the teacher reported log-probs for (with
    ``"student"``, at least every student id; with ``"intersection"``, the teacher's top-K).
    ``sampled_student`` / ``sampled_teacher``: both log-probs of the sampled token, used when
    the candidate set is empty. Raises ValueError on mismatched lengths, an unknown
    ``candidates``, or (``"student"``) a student id the teacher did not score.
    """
    if candidates not in CANDIDATES:
        raise ValueError(f"top-K reverse KL: candidates {candidates!r} is not one of {CANDIDATES}")
    if len(student_ids) != len(student_logprobs):
        raise ValueError(
            f"top-K reverse KL: {len(student_ids)} student ids but {len(student_logprobs)} student log-probs"
        )
    if len(teacher_ids) != len(teacher_logprobs):
        raise ValueError(
            f"top-K reverse KL: {len(teacher_ids)} teacher ids but {len(teacher_logprobs)} teacher log-probs"
        )
    teacher = dict(zip(teacher_ids, teacher_logprobs, strict=True))
    if candidates == "student":
        missing = [k for k in student_ids if k not in teacher]
        if missing:
            raise ValueError(
                f"top-K reverse KL: the teacher has no log-prob for student candidate ids {missing[:5]}"
            )
    chosen = [(lp, teacher[k]) for k, lp in zip(student_ids, student_logprobs, strict=True) if k in teacher]
    if not chosen:
        return sampled_student - sampled_teacher
    # Softmax of the student's log-probs over the candidates, shifted by the max for stability.
    top = max(lp for lp, _ in chosen)
    weights = [math.exp(lp - top) for lp, _ in chosen]
    total = sum(weights)
    # A candidate of weight 0 (student log-prob -inf) adds nothing, not 0 * -inf = nan.
    return sum(w * (lp_s - lp_t) for w, (lp_s, lp_t) in zip(weights, chosen, strict=True) if w > 0) / total


def reverse_kl_sequence(
    student_ids: Sequence[Sequence[int]],
    student_logprobs: Sequence[Sequence[float]],
    teacher_ids: Sequence[Sequence[int]],
    teacher_logprobs: Sequence[Sequence[float]],
    *,
    candidates: Candidates,
    sampled_student: Sequence[float],
    sampled_teacher: Sequence[float],
) -> list[float]:
    """:func:`reverse_kl_at` at every position of a response; all arguments have one row per token."""
    n = len(sampled_student)
    rows = {
        "student_ids": student_ids,
        "student_logprobs": student_logprobs,
        "teacher_ids": teacher_ids,
        "teacher_logprobs": teacher_logprobs,
        "sampled_teacher": sampled_teacher,
    }
    bad = {name: len(v) for name, v in rows.items() if len(v) != n}
    if bad:
        raise ValueError(f"top-K reverse KL: {n} positions in sampled_student, but row counts {bad}")
    return [
        reverse_kl_at(
            student_ids[t],
            student_logprobs[t],
            teacher_ids[t],
            teacher_logprobs[t],
            candidates=candidates,
            sampled_student=sampled_student[t],
            sampled_teacher=sampled_teacher[t],
        )
        for t in range(n)
    ]
