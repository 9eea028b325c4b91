"""The top-K reverse-KL estimate on hand-computed cases (expected values written from the formula)."""

from __future__ import annotations

import math

import pytest

from miles.distill.topk import reverse_kl_at, reverse_kl_sequence

LN = math.log


def test_student_candidates_weight_by_the_renormalised_student_probabilities() -> None:
    # Student top-2: p_s(5) = 0.5, p_s(7) = 0.25; teacher on those ids: p_t(5) = 0.25, p_t(7) = 0.5.
    # w = softmax(ln .5, ln .25) = (.5, .25) / .75 = (2/3, 1/3).
    # estimate = 2/3·(ln .5 − ln .25) + 1/3·(ln .25 − ln .5) = 2/3·ln 2 − 1/3·ln 2 = ln(2)/3 ≈ 0.231049.
    got = reverse_kl_at(
        [5, 7],
        [LN(0.5), LN(0.25)],
        [7, 5],  # the teacher's answer may list the ids in another order
        [LN(0.5), LN(0.25)],
        candidates="student",
        sampled_student=-9.0,
        sampled_teacher=-9.0,
    )
    assert got == pytest.approx(LN(2) / 3, abs=1e-12)
    assert got == pytest.approx(0.231049, abs=1e-6)


def test_intersection_keeps_only_ids_in_both_top_k_sets() -> None:
    # Student top-3 {5: .4, 7: .2, 9: .1}; teacher top-3 {7: .5, 9: .1, 11: .3}; C = {7, 9}.
    # w = (.2, .1) / .3 = (2/3, 1/3); terms: ln(.2/.5) = ln .4 and ln(.1/.1) = 0.
    # estimate = 2/3·ln 0.4 = 2/3·(−0.916291) ≈ −0.610861.
    got = reverse_kl_at(
        [5, 7, 9],
        [LN(0.4), LN(0.2), LN(0.1)],
        [7, 9, 11],
        [LN(0.5), LN(0.1), LN(0.3)],
        candidates="intersection",
        sampled_student=0.0,
        sampled_teacher=0.0,
    )
    assert got == pytest.approx(2 / 3 * LN(0.4), abs=1e-12)
    assert got == pytest.approx(-0.610861, abs=1e-6)


def test_an_empty_intersection_falls_back_to_the_sampled_token() -> None:
    # Disjoint sets: log p_s(x_t) − log p_t(x_t) = −1 − (−3) = 2.
    got = reverse_kl_at(
        [1, 2],
        [-0.5, -1.0],
        [3, 4],
        [-0.2, -2.0],
        candidates="intersection",
        sampled_student=-1.0,
        sampled_teacher=-3.0,
    )
    assert got == 2.0


def test_one_candidate_is_the_plain_log_ratio_and_equal_models_give_zero() -> None:
    # K = 1: w = 1, estimate = ln .6 − ln .3 = ln 2.
    assert reverse_kl_at(
        [4], [LN(0.6)], [4], [LN(0.3)], candidates="student", sampled_student=0.0, sampled_teacher=0.0
    ) == pytest.approx(LN(2), abs=1e-12)
    same = [LN(0.7), LN(0.2), LN(0.1)]
    assert reverse_kl_at(
        [0, 1, 2], same, [0, 1, 2], same, candidates="student", sampled_student=-5.0, sampled_teacher=-1.0
    ) == pytest.approx(0.0, abs=1e-12)


def test_extreme_log_probs_stay_stable() -> None:
    # Shifting both student log-probs by −1000 leaves the weights (2/3, 1/3) unchanged (softmax is shift
    # invariant); the teacher is 1000 nats lower than the student on both ids, so the estimate is 1000.
    got = reverse_kl_at(
        [1, 2],
        [-1000 + LN(0.5), -1000 + LN(0.25)],
        [1, 2],
        [-2000 + LN(0.5), -2000 + LN(0.25)],
        candidates="student",
        sampled_student=0.0,
        sampled_teacher=0.0,
    )
    assert got == pytest.approx(1000.0, abs=1e-9)
    # A candidate of zero student probability (log-prob −inf) contributes nothing rather than nan:
    # w = (1, 0), estimate = ln .5 − ln .25 = ln 2.
    got = reverse_kl_at(
        [1, 2],
        [LN(0.5), -math.inf],
        [1, 2],
        [LN(0.25), -3.0],
        candidates="student",
        sampled_student=0.0,
        sampled_teacher=0.0,
    )
    assert got == pytest.approx(LN(2), abs=1e-12)


def test_sequence_applies_the_estimate_at_every_position() -> None:
    # Position 0 is the first case above (ln(2)/3); position 1 falls back to −0.5 − (−0.25) = −0.25.
    got = reverse_kl_sequence(
        [[5, 7], [1]],
        [[LN(0.5), LN(0.25)], [-0.1]],
        [[5, 7], [2]],
        [[LN(0.25), LN(0.5)], [-0.3]],
        candidates="intersection",
        sampled_student=[-9.0, -0.5],
        sampled_teacher=[-9.0, -0.25],
    )
    assert got == pytest.approx([LN(2) / 3, -0.25], abs=1e-12)
    assert (
        reverse_kl_sequence([], [], [], [], candidates="student", sampled_student=[], sampled_teacher=[])
        == []
    )


def test_bad_input_is_refused_with_a_clear_error() -> None:
    kw = {"sampled_student": 0.0, "sampled_teacher": 0.0}
    with pytest.raises(ValueError, match=r"no log-prob for student candidate ids \[9\]"):
        reverse_kl_at([5, 9], [-1.0, -2.0], [5], [-1.0], candidates="student", **kw)
    with pytest.raises(ValueError, match="candidates 'union' is not one of"):
        reverse_kl_at([5], [-1.0], [5], [-1.0], candidates="union", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 student ids but 1 student log-probs"):
        reverse_kl_at([5, 6], [-1.0], [5], [-1.0], candidates="student", **kw)
    with pytest.raises(ValueError, match=r"row counts \{'teacher_ids': 1\}"):
        reverse_kl_sequence(
            [[1], [2]],
            [[-1.0], [-1.0]],
            [[1]],
            [[-1.0], [-1.0]],
            candidates="student",
            sampled_student=[0.0, 0.0],
            sampled_teacher=[0.0, 0.0],
        )
