"""ClipOrPop: the unclipped ratio inside the interval, 0 outside; same metrics as TruncatedIS."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.ppo_clip import PPOClipLoss
from miles.builtins.algorithms.tis import ClipOrPop, TruncatedIS
from miles.errors import ConfigError
from miles.interfaces import Correction, LossInputs
from miles.plugins import make_component

torch = pytest.importorskip("torch")

INF = float("inf")


def test_by_name_with_the_default_interval() -> None:
    corr = make_component("correction", "clip_or_pop", {})
    assert isinstance(corr, ClipOrPop) and isinstance(corr, Correction)
    assert (corr.low, corr.high) == (0.0, 2.0)


def test_pops_outside_and_passes_the_ratio_inside() -> None:
    # r = [1.7, 0.2, 3.0, ·(masked, r = 8)] with [0, 2]: weights [1.7, 0.2, 0 (popped), 1 (masked)]
    old = torch.tensor([[math.log(1.7), math.log(0.2), math.log(3.0), math.log(8.0)]])
    out = ClipOrPop()(old, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert out.weights.tolist()[0] == pytest.approx([1.7, 0.2, 0.0, 1.0])
    assert not out.weights.requires_grad
    # ratio_mean (pre-clamp) = (1.7 + 0.2 + 3) / 3 = 4.9 / 3; popped 1 of 3; |r - 1| = (0.7 + 0.8 + 2) / 3
    assert out.metrics == pytest.approx(
        {"correction/ratio_mean": 4.9 / 3, "correction/clipped_frac": 1 / 3, "correction/abs_dev": 3.5 / 3}
    )


def test_same_metrics_as_truncated_is() -> None:
    # Only the weights differ: TIS damps 3.0 to 2.0, clip-or-pop drops it.
    old = torch.tensor([[math.log(1.7), math.log(0.2), math.log(3.0)]])
    args = (old, torch.zeros(1, 3), torch.ones(1, 3))
    tis, pop = TruncatedIS()(*args), ClipOrPop()(*args)
    assert pop.metrics == tis.metrics
    assert tis.weights.tolist()[0] == pytest.approx([1.7, 0.2, 2.0])
    assert pop.weights.tolist()[0] == pytest.approx([1.7, 0.2, 0.0])


def test_interval_bounds_are_inclusive_and_masked_tokens_keep_weight_one() -> None:
    # [1, 1.5]: r = 1 (log 0) sits on the bound and is kept; r = 0.5 is popped; the masked token
    # (r = 1 after masking, also r = 0.5 before) keeps weight 1.
    old = torch.tensor([[0.0, math.log(0.5), math.log(0.5)]])
    out = ClipOrPop(low=1.0, high=1.5)(old, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    assert out.weights.tolist()[0] == pytest.approx([1.0, 0.0, 1.0])


def test_a_popped_token_drops_out_like_a_masked_one() -> None:
    # PPO with clip-or-pop weights equals PPO with the popped token masked (same global denominator).
    logprobs = torch.tensor([[math.log(1.1), math.log(0.9), math.log(1.2)]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    zeros = torch.zeros(1, 3, dtype=torch.float64)
    rollout = torch.tensor([[0.0, 0.0, -5.0]], dtype=torch.float64)  # token 2: r = e^5 > 2, popped

    def loss(mask: list[float], weights: torch.Tensor | None) -> tuple[float, list[float]]:
        lp = logprobs.clone().requires_grad_(True)
        x = LossInputs(
            logprobs=lp,
            old_logprobs=zeros,
            advantages=adv,
            loss_mask=torch.tensor([mask], dtype=torch.float64),
            correction_weights=weights,
            num_loss_tokens=3,
        )
        out = PPOClipLoss()(x).loss
        out.backward()
        return out.item(), lp.grad.flatten().tolist()

    weights = ClipOrPop()(zeros, rollout, torch.ones(1, 3)).weights.double()
    popped_loss, popped_grad = loss([1.0, 1.0, 1.0], weights)
    masked_loss, masked_grad = loss([1.0, 1.0, 0.0], None)
    assert popped_loss == pytest.approx(masked_loss)
    assert popped_grad == pytest.approx(masked_grad)


def test_extreme_inputs_stay_finite() -> None:
    # log r = [-20 (clamped), +20, 0 (nan), +20, -20] -> r = [e^-20, e^20, 1, e^20, e^-20]; e^20 is popped.
    old = torch.tensor([[-INF, 0.0, -INF, 1e30, -1e30]])
    rollout = torch.tensor([[0.0, -INF, -INF, -1e30, 1e30]])
    out = ClipOrPop()(old, rollout, torch.ones(1, 5))
    assert out.weights.tolist()[0] == pytest.approx([math.exp(-20), 0.0, 1.0, 0.0, math.exp(-20)])
    assert out.metrics["correction/clipped_frac"] == pytest.approx(2 / 5)
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_bad_bounds_and_shapes() -> None:
    with pytest.raises(ConfigError, match="clip_or_pop: need 0 <= low < high"):
        ClipOrPop(low=1.0, high=1.0)
    with pytest.raises(ConfigError, match="clip_or_pop: need 0 <= low < high"):
        ClipOrPop(low=-0.1)
    with pytest.raises(ValueError, match="clip_or_pop: shapes differ"):
        ClipOrPop()(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
