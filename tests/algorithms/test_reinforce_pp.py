"""REINFORCE++ (plain and with a group baseline) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.reinforce_pp import (
    ReinforcePPAdvantage,
    ReinforcePPBaselineAdvantage,
    discounted_returns,
)
from miles.errors import ConfigError
from miles.interfaces import AdvantageEstimator
from miles.plugins import make_component
from miles.types import Group, Prompt, Sample

torch = pytest.importorskip("torch")

E = 1e-8  # the whitening epsilon


def make_sample(
    mask: list[int], reward: float | None, logprobs: list[float] | None = None, ref: list[float] | None = None
) -> Sample:
    s = Sample(
        prompt=Prompt(index=0, prompt="q"),
        response_ids=[3] * len(mask),
        loss_mask=mask,
        rollout_logprobs=logprobs if logprobs is not None else [-1.0] * len(mask),
        reward=reward,
    )
    if ref is not None:
        s.token_scores["ref_logprobs"] = ref
    return s


def groups_of(*samples_per_group: list[Sample], first_index: int = 0) -> list[Group]:
    groups = []
    for k, samples in enumerate(samples_per_group):
        prompt = Prompt(index=first_index + k, prompt="q")
        for i, s in enumerate(samples):
            s.prompt, s.group_index = prompt, i
        groups.append(Group(prompt=prompt, samples=samples))
    return groups


# ----------------------------------------------------------------- REINFORCE++


def test_discount_runs_over_loss_tokens_only() -> None:
    # mask 1,0,1, reward 1 at the last loss token; compressed rewards [0, 1] with γ = 0.5:
    # G = [0 + 0.5·1, 1] = [0.5, 1] (over the full response it would be 0.25 at t = 0).
    est = ReinforcePPAdvantage(gamma=0.5, normalize=False)
    assert isinstance(est, AdvantageEstimator)
    out = est(groups_of([make_sample([1, 0, 1], 1.0)]))
    assert out.advantages == [[0.5, 0.0, 1.0]] and out.returns is None
    # The reward goes to the last *loss* token, not the last response token: mask 1,1,0,0, γ = 0.5.
    out = est(groups_of([make_sample([1, 1, 0, 0], 2.0)]))
    assert out.advantages == [[1.0, 2.0, 0.0, 0.0]]


def test_kl_shaped_token_rewards() -> None:
    # k1 = logp - ref: [-1 - (-1.5), masked, -2 - (-1)] = [0.5, -, -1]; kl_coef 0.1 ->
    # r = [-0.05, 1 + 0.1] = [-0.05, 1.1] over the loss tokens; γ = 0.5:
    # G_1 = 1.1, G_0 = -0.05 + 0.5·1.1 = 0.5. The masked token's (huge) log-ratio is ignored.
    est = ReinforcePPAdvantage(gamma=0.5, kl_coef=0.1, normalize=False)
    assert est.requires == frozenset({"ref_logprobs"})
    out = est(groups_of([make_sample([1, 0, 1], 1.0, logprobs=[-1.0, -30.0, -2.0], ref=[-1.5, 0.0, -1.0])]))
    assert out.advantages[0] == pytest.approx([0.5, 0.0, 1.1], abs=1e-12)
    assert out.metrics["advantages/ref_kl"] == pytest.approx((0.5 - 1.0) / 2)
    # k2 = d²/2: [0.125, 0.5] -> r = [-0.0125, 1 - 0.05] = [-0.0125, 0.95]; G_0 = -0.0125 + 0.475.
    est = ReinforcePPAdvantage(gamma=0.5, kl_coef=0.1, kl_type="k2", normalize=False)
    out = est(groups_of([make_sample([1, 0, 1], 1.0, logprobs=[-1.0, -30.0, -2.0], ref=[-1.5, 0.0, -1.0])]))
    assert out.advantages[0] == pytest.approx([0.4625, 0.0, 0.95], abs=1e-12)


def test_whitened_across_the_whole_batch_by_default() -> None:
    # γ = 1, no KL: returns 1, 1 (reward 1, two loss tokens) and 0 (reward 0, one loss token).
    # mean 2/3, var ((1/3)² + (1/3)² + (2/3)²) / 2 = 1/3 -> (1/3) / sqrt(1/3) = 1/sqrt(3), -2/sqrt(3).
    out = ReinforcePPAdvantage()(groups_of([make_sample([1, 1], 1.0)], [make_sample([0, 1], 0.0)]))
    s = math.sqrt(1 / 3 + E)
    assert out.advantages[0] == pytest.approx([(1 / 3) / s, (1 / 3) / s], abs=1e-12)
    assert out.advantages[1] == pytest.approx([0.0, (-2 / 3) / s], abs=1e-12)
    assert out.metrics["advantages/mean_raw"] == pytest.approx(2 / 3)
    assert out.metrics["advantages/std_raw"] == pytest.approx(math.sqrt(1 / 3))


def test_identical_returns_fully_masked_and_empty() -> None:
    # Every loss token has return 1: whitening gives exact zeros, not nan.
    out = ReinforcePPAdvantage()(groups_of([make_sample([1, 1], 1.0), make_sample([0, 1, 1], 1.0)]))
    assert out.advantages == [[0.0, 0.0], [0.0, 0.0, 0.0]]
    # A sample with no loss token has nowhere to put its reward: all zeros, the others unaffected.
    out = ReinforcePPAdvantage(normalize=False)(groups_of([make_sample([0, 0], 5.0), make_sample([1], None)]))
    assert out.advantages == [[0.0, 0.0], [0.0]]
    assert ReinforcePPAdvantage()([]).advantages == []


def test_discounted_returns_batched_and_1d() -> None:
    # r = [1, 2, 3], γ = 0.5: G_2 = 3, G_1 = 2 + 1.5 = 3.5, G_0 = 1 + 1.75 = 2.75.
    r = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert discounted_returns(r, 0.5).tolist() == [2.75, 3.5, 3.0]
    # Batched with a mask: the second row skips its middle token -> [1 + 0.5·3, 0, 3].
    rows = torch.stack([r, r])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    assert discounted_returns(rows, 0.5, mask).tolist() == [[2.75, 3.5, 3.0], [2.5, 0.0, 3.0]]


# ------------------------------------------------------------ group baseline


def test_baseline_subtracts_the_group_mean_and_the_kl() -> None:
    # Group rewards 1, 0, 0.5: mean 0.5 -> centered 0.5, -0.5, 0.
    # kl k3 = exp(-d) + d - 1 with d = logp - ref: sample 0 d = [0.5, 0] -> [0.1065307, 0];
    # kl_coef 0.2 -> A = [0.5 - 0.0213061, 0.5]. Sample 1: d = 0 on its loss token.
    k3 = math.exp(-0.5) + 0.5 - 1
    est = ReinforcePPBaselineAdvantage(kl_coef=0.2, kl_type="k3", normalize=False)
    assert est.requires == frozenset({"ref_logprobs"})
    group = [
        make_sample([1, 1], 1.0, logprobs=[-1.0, -1.0], ref=[-1.5, -1.0]),
        make_sample([1, 0], 0.0, logprobs=[-1.0, -1.0], ref=[-1.0, -40.0]),
        make_sample([1], 0.5, logprobs=[-2.0], ref=[-2.0]),
    ]
    out = est(groups_of(group))
    assert out.advantages[0] == pytest.approx([0.5 - 0.2 * k3, 0.5], abs=1e-12)
    assert out.advantages[1] == pytest.approx([-0.5, 0.0], abs=1e-12)
    assert out.advantages[2] == pytest.approx([0.0], abs=1e-12)
    assert out.metrics["advantages/ref_kl"] == pytest.approx(k3 / 4)


def test_baseline_per_group_and_whitened() -> None:
    # Group A rewards 2, 0 -> centered 1, -1; group B rewards 3, 3 -> 0, 0 (exactly).
    # Loss tokens: 1, 1 (sample A0, two tokens), -1, 0, 0 -> mean 1/5,
    # var ((4/5)²·2 + (6/5)² + (1/5)²·2) / 4 = (32 + 36 + 2) / 100 = 0.7.
    groups = groups_of(
        [make_sample([1, 1], 2.0), make_sample([1], 0.0)], [make_sample([1], 3.0), make_sample([1], 3.0)]
    )
    out = ReinforcePPBaselineAdvantage()(groups)
    s = math.sqrt(0.7 + E)
    flat = [v for row in out.advantages for v in row]
    assert flat == pytest.approx([0.8 / s, 0.8 / s, -1.2 / s, -0.2 / s, -0.2 / s], abs=1e-12)
    # A batch of identical groups: all zeros, no nan.
    out = ReinforcePPBaselineAdvantage()(groups_of([make_sample([1], 1.0), make_sample([1, 0], 1.0)]))
    assert out.advantages == [[0.0], [0.0, 0.0]]


# ------------------------------------------------------------- options, errors


def test_requires_and_default_loss_follow_the_options() -> None:
    for est in (ReinforcePPAdvantage(), ReinforcePPBaselineAdvantage()):
        assert est.requires == frozenset() and est.default_loss == "ppo_clip"
    est = make_component("advantage", "reinforce_pp", {"gamma": 0.9, "kl_coef": 0.01, "kl_type": "k3"})
    assert isinstance(est, ReinforcePPAdvantage) and (est.gamma, est.kl_type) == (0.9, "k3")
    assert est.requires == frozenset({"ref_logprobs"})
    est = make_component("advantage", "reinforce_pp_baseline", {"normalize": False})
    assert isinstance(est, ReinforcePPBaselineAdvantage) and not est.normalize


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gamma": 1.5}, "gamma must be a number in"),
        ({"gamma": "0.9"}, "gamma must be a number in"),
        ({"kl_coef": -0.1}, "kl_coef must be a finite number >= 0"),
        ({"kl_coef": float("inf")}, "kl_coef must be a finite number >= 0"),
        ({"kl_type": "k4"}, "kl_type must be one of k1, k2, k3"),
        ({"normalize": "yes"}, "normalize must be true or false"),
    ],
)
def test_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReinforcePPAdvantage(**options)
    if "gamma" not in options:
        with pytest.raises(ConfigError, match=message):
            ReinforcePPBaselineAdvantage(**options)


def test_missing_reference_log_probs_name_the_sample() -> None:
    groups = groups_of([make_sample([1], 1.0, ref=[-1.0]), make_sample([1], 0.0)], first_index=7)
    for est in (ReinforcePPAdvantage(kl_coef=0.1), ReinforcePPBaselineAdvantage(kl_coef=0.1)):
        with pytest.raises(ValueError, match=r"sample 1 of prompt 7 has no token_scores\['ref_logprobs'\]"):
            est(groups)
    # Without a KL coefficient the reference is never read.
    assert ReinforcePPAdvantage(normalize=False)(groups).advantages == [[1.0], [0.0]]
    groups[0].samples[1].token_scores["ref_logprobs"] = [-1.0]
    groups[0].samples[0].token_scores["ref_logprobs"] = [-1.0, -1.0]
    with pytest.raises(
        ValueError, match=r"sample 0 of prompt 7: token_scores\['ref_logprobs'\] has 2 entries"
    ):
        ReinforcePPAdvantage(kl_coef=0.1)(groups)
