"""Folding the on-policy-distillation reverse-KL estimate into advantages, by hand and after estimators."""

from __future__ import annotations

import copy
import math

import pytest

from miles.builtins.algorithms.gae import PPOAdvantage
from miles.builtins.algorithms.grpo import GRPOAdvantage
from miles.builtins.algorithms.opd import fold_reverse_kl
from miles.types import Group, Prompt, Sample

pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")


def make_sample(
    mask: list[int], logprobs: list[float], index: int = 0, reward: float = 0.0, **scores: list[float]
) -> Sample:
    return Sample(
        prompt=Prompt(index=index, prompt="q"),
        response_ids=[3] * len(mask),
        loss_mask=mask,
        rollout_logprobs=logprobs,
        reward=reward,
        token_scores=dict(scores),
    )


def test_teacher_log_probs_by_hand() -> None:
    # rkl = student - teacher on loss tokens: [-1 - (-2), masked, -0.5 - (-0.5)] = [1, -, 0].
    # coef 0.5: [1 - 0.5·1, 0, 1 - 0] = [0.5, 0, 1]; the masked token's advantage is zeroed too.
    s = make_sample([1, 0, 1], [-1.0, -2.0, -0.5], teacher_logprobs=[-2.0, -0.1, -0.5])
    rows, metrics = fold_reverse_kl([s], [[1.0, 3.0, 1.0]], coef=0.5)
    assert rows == [[0.5, 0.0, 1.0]]
    assert metrics == {"distill/reverse_kl": 0.5, "distill/teacher_logprob_mean": -1.25}


def test_precomputed_top_k_estimate_wins_and_mixes_with_teacher_samples() -> None:
    # Sample 0 carries both: opd_reverse_kl [0.2, 0.4] is used (not student - teacher).
    # Sample 1 only teacher log-probs: rkl = [-1 - (-1.5)] = [0.5].
    # coef 1: [1 - 0.2, 1 - 0.4], [0 - 0.5]; reverse_kl mean (0.2 + 0.4 + 0.5) / 3.
    a = make_sample([1, 1], [-1.0, -1.0], opd_reverse_kl=[0.2, 0.4], teacher_logprobs=[-9.0, -9.0])
    b = make_sample([1], [-1.0], teacher_logprobs=[-1.5])
    rows, metrics = fold_reverse_kl([a, b], [[1.0, 1.0], [0.0]], coef=1.0)
    assert rows[0] == pytest.approx([0.8, 0.6], abs=1e-12)
    assert rows[1] == pytest.approx([-0.5], abs=1e-12)
    assert metrics["distill/reverse_kl"] == pytest.approx(1.1 / 3)
    # Teacher log-probs of every sample that has them, on its loss tokens: (-9 - 9 - 1.5) / 3.
    assert metrics["distill/teacher_logprob_mean"] == pytest.approx(-19.5 / 3)
    rows, metrics = fold_reverse_kl([a], [[0.0, 0.0]], coef=2.0)
    assert "distill/teacher_logprob_mean" in metrics
    c = make_sample([1], [-1.0], opd_reverse_kl=[0.25])
    rows, metrics = fold_reverse_kl([c], [[0.0]], coef=2.0)
    assert rows == [[-0.5]] and metrics == {"distill/reverse_kl": 0.25}


def test_non_finite_inputs_stay_finite() -> None:
    # teacher -inf: student - teacher = +inf, clamped to 20; teacher +inf: -20; nan counts as 0.
    s = make_sample([1, 1, 1, 1], [-1.0, -1.0, -1.0, -1.0], teacher_logprobs=[-INF, INF, NAN, -3.0])
    rows, metrics = fold_reverse_kl([s], [[0.0] * 4], coef=0.5)
    assert rows == [[-10.0, 10.0, 0.0, -1.0]]
    assert metrics["distill/reverse_kl"] == pytest.approx((20 - 20 + 0 + 2) / 4)
    # The teacher mean counts finite log-probs only.
    assert metrics["distill/teacher_logprob_mean"] == -3.0
    pre = make_sample([1, 1, 1], [-1.0] * 3, opd_reverse_kl=[INF, NAN, -1e9])
    rows, _ = fold_reverse_kl([pre], [[0.0] * 3], coef=1.0)
    assert rows == [[-20.0, 0.0, 20.0]]
    assert all(math.isfinite(v) for v in rows[0])


def test_inputs_are_not_mutated() -> None:
    s = make_sample([1, 1], [-1.0, -2.0], teacher_logprobs=[-1.0, -1.0])
    before = copy.deepcopy(s)
    advantages = [[1.0, 1.0]]
    rows, _ = fold_reverse_kl([s], advantages, coef=1.0)
    assert advantages == [[1.0, 1.0]] and rows == [[1.0, 2.0]]
    assert rows is not advantages and rows[0] is not advantages[0]
    assert s == before


def test_errors_name_the_sample_and_what_is_missing() -> None:
    ok = make_sample([1], [-1.0], teacher_logprobs=[-1.0])
    bare = make_sample([1, 0], [-1.0, -1.0], index=12)
    with pytest.raises(
        ValueError, match=r"sample 0 of prompt 12 has neither token_scores\['opd_reverse_kl'\]"
    ):
        fold_reverse_kl([ok, bare], [[0.0], [0.0, 0.0]], coef=1.0)
    short = make_sample([1, 1], [-1.0, -1.0], index=5, teacher_logprobs=[-1.0])
    with pytest.raises(
        ValueError, match=r"prompt 5: token_scores\['teacher_logprobs'\] has 1 entries, response has 2"
    ):
        fold_reverse_kl([short], [[0.0, 0.0]], coef=1.0)
    short = make_sample([1, 1], [-1.0, -1.0], index=5, opd_reverse_kl=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"prompt 5: token_scores\['opd_reverse_kl'\] has 3 entries"):
        fold_reverse_kl([short], [[0.0, 0.0]], coef=1.0)
    with pytest.raises(ValueError, match=r"prompt 0: advantages has 2 entries, response has 1 tokens"):
        fold_reverse_kl([ok], [[0.0, 0.0]], coef=1.0)
    with pytest.raises(ValueError, match="1 advantage rows for 2 samples"):
        fold_reverse_kl([ok, ok], [[0.0]], coef=1.0)
    with pytest.raises(ValueError, match="coef must be a finite number >= 0"):
        fold_reverse_kl([ok], [[0.0]], coef=-1.0)


def group_of(*samples: Sample) -> Group:
    prompt = Prompt(index=0, prompt="q")
    for i, s in enumerate(samples):
        s.prompt, s.group_index = prompt, i
    return Group(prompt=prompt, samples=list(samples))


def test_after_grpo() -> None:
    # GRPO: rewards 1, 0 -> +-0.5 / (sqrt(0.5) + 1e-6) = +-0.7071058 on loss tokens.
    # rkl: sample 0 [-1 - (-1.2), masked] = [0.2]; sample 1 [-0.5 - (-0.5), -2 - (-1)] = [0, -1].
    # coef 0.1 -> [0.7071058 - 0.02, 0], [-0.7071058, -0.7071058 + 0.1].
    g = group_of(
        make_sample([1, 0], [-1.0, -7.0], reward=1.0, teacher_logprobs=[-1.2, -0.1]),
        make_sample([1, 1], [-0.5, -2.0], reward=0.0, teacher_logprobs=[-0.5, -1.0]),
    )
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    out = GRPOAdvantage()([g])
    rows, metrics = fold_reverse_kl(g.samples, out.advantages, coef=0.1)
    assert rows[0] == pytest.approx([a - 0.02, 0.0], abs=1e-12)
    assert rows[1] == pytest.approx([-a, -a + 0.1], abs=1e-12)
    assert metrics["distill/reverse_kl"] == pytest.approx((0.2 + 0 - 1) / 3)
    # Task reward set to zero: GRPO gives 0 everywhere, so the teacher signal is all there is.
    for s in g.samples:
        s.reward = 0.0
    rows, _ = fold_reverse_kl(g.samples, GRPOAdvantage()([g]).advantages, coef=1.0)
    assert rows[0] == pytest.approx([-0.2, 0.0]) and rows[1] == pytest.approx([0.0, 1.0])


def test_after_ppo() -> None:
    # PPO, γ = λ = 1, no KL, not whitened: reward 1 at the last loss token, V = [0.25, 0.5]
    # -> A = [0.75, 0.5], returns [1, 1]. rkl = [-1 - (-1.5), -1 - (-0.5)] = [0.5, -0.5], coef 0.2
    # -> [0.75 - 0.1, 0.5 + 0.1]. The critic's returns are the estimator's, untouched by the fold.
    s = make_sample([1, 1], [-1.0, -1.0], reward=1.0, teacher_logprobs=[-1.5, -0.5], values=[0.25, 0.5])
    out = PPOAdvantage(normalize=False)([group_of(s)])
    rows, _ = fold_reverse_kl([s], out.advantages, coef=0.2)
    assert rows == [pytest.approx([0.65, 0.6], abs=1e-12)]
    assert out.returns == [[1.0, 1.0]] and out.advantages == [[0.75, 0.5]]
