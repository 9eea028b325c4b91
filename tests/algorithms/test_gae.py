"""GAE against a serial reference and hand-computed cases; PPOAdvantage end to end on small batches."""

from __future__ import annotations

import math
import random

import pytest

from miles.builtins.algorithms.gae import PPOAdvantage, gae
from miles.errors import ConfigError
from miles.interfaces import AdvantageEstimator
from miles.plugins import make_component
from miles.types import Group, Prompt, Sample, Status

torch = pytest.importorskip("torch")


def serial_gae(
    rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float
) -> list[float]:
    """The textbook recursion over the loss tokens of one sequence, written independently of gae.py.

    delta_t = r_t + gamma·V_{t+1} - V_t and A_t = delta_t + gamma·lam·A_{t+1}, where t + 1 is the
    next loss token and V, A after the last one are 0. Other positions get 0.
    """
    steps = [t for t, m in enumerate(mask) if m]
    out = [0.0] * len(mask)
    next_value = 0.0
    next_adv = 0.0
    for t in reversed(steps):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        out[t] = next_adv
        next_value = values[t]
    return out


def test_hand_computed_three_token_cases() -> None:
    r = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    v = torch.tensor([0.5, 0.4, 0.2], dtype=torch.float64)
    # γ = λ = 1: A_t = (sum of rewards from t) - V_t = [1 - 0.5, 1 - 0.4, 1 - 0.2].
    assert gae(r, v, 1.0, 1.0).tolist() == pytest.approx([0.5, 0.6, 0.8], abs=1e-12)
    # γ = 0.9, λ = 0.5: δ_2 = 1 - 0.2 = 0.8; δ_1 = 0.9·0.2 - 0.4 = -0.22; δ_0 = 0.9·0.4 - 0.5 = -0.14;
    # A_2 = 0.8, A_1 = -0.22 + 0.45·0.8 = 0.14, A_0 = -0.14 + 0.45·0.14 = -0.077.
    assert gae(r, v, 0.9, 0.5).tolist() == pytest.approx([-0.077, 0.14, 0.8], abs=1e-12)
    # λ = 0: A = δ (one-step TD errors).
    assert gae(r, v, 0.9, 0.0).tolist() == pytest.approx([-0.14, -0.22, 0.8], abs=1e-12)
    # A masked middle token: its reward and value are ignored, no decay across it.
    # Compressed r = [0, 1], V = [0.5, 0.2]: A_1 = 0.8, A_0 = 0.9·0.2 - 0.5 + 0.45·0.8 = 0.04.
    r = torch.tensor([[0.0, 5.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 9.0, 0.2]], dtype=torch.float64)
    got = gae(r, v, 0.9, 0.5, mask=torch.tensor([[1, 0, 1]]))
    assert got.tolist()[0] == pytest.approx([0.04, 0.0, 0.8], abs=1e-12)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)])
def test_matches_the_serial_reference_on_random_masked_batches(gamma: float, lam: float) -> None:
    rng = random.Random(1234)
    for _ in range(5):
        rows, width = 6, 17
        rewards = [[rng.gauss(0, 1) for _ in range(width)] for _ in range(rows)]
        values = [[rng.gauss(0, 1) for _ in range(width)] for _ in range(rows)]
        # Runs of loss tokens and observation spans, plus one row with no loss token at all.
        masks = [[int(rng.random() < 0.6) for _ in range(width)] for _ in range(rows - 1)] + [[0] * width]
        got = gae(
            torch.tensor(rewards, dtype=torch.float64),
            torch.tensor(values, dtype=torch.float64),
            gamma,
            lam,
            mask=torch.tensor(masks),
        )
        for i in range(rows):
            want = serial_gae(rewards[i], values[i], masks[i], gamma, lam)
            assert got[i].tolist() == pytest.approx(want, abs=1e-12)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"gae: rewards has shape \(3,\), values \(2,\)"):
        gae(torch.zeros(3), torch.zeros(2), 1.0, 1.0)


# ------------------------------------------------------------------ estimator


def make_sample(
    mask: list[int],
    reward: float,
    values: list[float] | None,
    logprobs: list[float] | None = None,
    ref: list[float] | None = None,
    status: Status = Status.COMPLETED,
) -> Sample:
    s = Sample(
        prompt=Prompt(index=0, prompt="q"),
        response_ids=[3] * len(mask),
        loss_mask=mask,
        rollout_logprobs=logprobs if logprobs is not None else [-1.0] * len(mask),
        reward=reward,
        status=status,
    )
    if values is not None:
        s.token_scores["values"] = values
    if ref is not None:
        s.token_scores["ref_logprobs"] = ref
    return s


def one_group(*samples: Sample, index: int = 0) -> list[Group]:
    prompt = Prompt(index=index, prompt="q")
    for i, s in enumerate(samples):
        s.prompt, s.group_index = prompt, i
    return [Group(prompt=prompt, samples=list(samples))]


def two_samples() -> list[Group]:
    return one_group(
        # k1 = -1 - (-1.5) = 0.5 on both loss tokens; the masked token's value 9 is never used.
        make_sample([1, 0, 1], 1.0, [0.5, 9.0, 0.2], logprobs=[-1.0, -1.0, -1.0], ref=[-1.5, 0.0, -1.5]),
        make_sample([1, 1], 0.0, [0.1, 0.3], logprobs=[-1.0, -1.0], ref=[-1.0, -1.0]),
    )


def test_ppo_advantages_and_returns_by_hand() -> None:
    # γ = 0.9, λ = 0.8, kl_coef = 0.1.
    # Sample 0, compressed: r = [-0.05, 1 - 0.05] = [-0.05, 0.95], V = [0.5, 0.2]:
    #   A_1 = 0.95 - 0.2 = 0.75; A_0 = -0.05 + 0.9·0.2 - 0.5 + 0.72·0.75 = 0.17; returns = A + V = [0.67, 0.95].
    # Sample 1: r = [0, 0], V = [0.1, 0.3]:
    #   A_1 = -0.3; A_0 = 0.9·0.3 - 0.1 + 0.72·(-0.3) = -0.046; returns = [0.054, 0.0].
    est = PPOAdvantage(gamma=0.9, lam=0.8, kl_coef=0.1, normalize=False)
    assert isinstance(est, AdvantageEstimator)
    out = est(two_samples())
    assert out.advantages[0] == pytest.approx([0.17, 0.0, 0.75], abs=1e-12)
    assert out.advantages[1] == pytest.approx([-0.046, -0.3], abs=1e-12)
    assert out.returns is not None
    assert out.returns[0] == pytest.approx([0.67, 0.0, 0.95], abs=1e-12)
    assert out.returns[1] == pytest.approx([0.054, 0.0], abs=1e-12)
    assert out.metrics["advantages/values_mean"] == pytest.approx((0.5 + 0.2 + 0.1 + 0.3) / 4)
    assert out.metrics["advantages/returns_mean"] == pytest.approx((0.67 + 0.95 + 0.054 + 0.0) / 4)
    assert out.metrics["advantages/ref_kl"] == pytest.approx((0.5 + 0.5) / 4)


def test_ppo_whitens_advantages_but_not_returns() -> None:
    # Same raw advantages as above: 0.17, 0.75, -0.046, -0.3 -> mean 0.1435,
    # var = (0.0265² + 0.6065² + 0.1895² + 0.4435²) / 3 = 0.601147 / 3.
    out = PPOAdvantage(gamma=0.9, lam=0.8, kl_coef=0.1)(two_samples())
    s = math.sqrt(0.601147 / 3 + 1e-8)
    assert out.advantages[0] == pytest.approx([0.0265 / s, 0.0, 0.6065 / s], abs=1e-9)
    assert out.advantages[1] == pytest.approx([-0.1895 / s, -0.4435 / s], abs=1e-9)
    assert out.returns is not None and out.returns[0] == pytest.approx([0.67, 0.0, 0.95], abs=1e-12)
    assert out.metrics["advantages/mean_raw"] == pytest.approx(0.1435)
    assert out.metrics["advantages/std_raw"] == pytest.approx(math.sqrt(0.601147 / 3))


def test_truncated_samples_bootstrap_zero_too() -> None:
    # γ = λ = 1, reward 1 at the last loss token, V = [0.25, 0.5] -> A = [1 - 0.25, 1 - 0.5].
    for status in (Status.COMPLETED, Status.TRUNCATED):
        out = PPOAdvantage(normalize=False)(one_group(make_sample([1, 1], 1.0, [0.25, 0.5], status=status)))
        assert out.advantages == [[0.75, 0.5]]
        assert out.returns == [[1.0, 1.0]]


def test_requires_and_missing_values() -> None:
    assert PPOAdvantage().requires == frozenset({"values"})
    assert PPOAdvantage().default_loss == "ppo_clip"
    est = make_component("advantage", "ppo", {"gamma": 0.99, "lam": 0.95, "kl_coef": 0.05})
    assert isinstance(est, PPOAdvantage) and (est.gamma, est.lam) == (0.99, 0.95)
    assert est.requires == frozenset({"values", "ref_logprobs"})
    groups = one_group(make_sample([1], 1.0, [0.0]), make_sample([1, 1], 0.0, None), index=4)
    with pytest.raises(ValueError, match=r"ppo: sample 1 of prompt 4 has no token_scores\['values'\]"):
        PPOAdvantage()(groups)
    groups[0].samples[1].token_scores["values"] = [0.0]
    with pytest.raises(ValueError, match=r"sample 1 of prompt 4: token_scores\['values'\] has 1 entries"):
        PPOAdvantage()(groups)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lam": 1.5}, "lam must be a number in"),
        ({"gamma": -0.1}, "gamma must be a number in"),
        ({"kl_coef": -1}, "kl_coef must be"),
        ({"kl_type": "low_var_kl"}, "kl_type must be one of"),
        ({"normalize": 1}, "normalize must be true or false"),
    ],
)
def test_bad_options(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PPOAdvantage(**options)
