"""PPOClipLoss against values computed by hand from the formula."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.ppo_clip import PPOClipLoss
from miles.errors import ConfigError
from miles.interfaces import Loss, LossInputs

torch = pytest.importorskip("torch")

# Five tokens, old log-probs 0, so ratio = exp(logprobs). clip_low 0.2, clip_high 0.28: ratio bounds [0.8, 1.28].
#   t0 ratio 1.5, A +1: max(-1.5, -1.28) = -1.28   clipped
#   t1 ratio 0.5, A +1: max(-0.5, -0.8)  = -0.5
#   t2 ratio 0.5, A -1: max(0.5, 0.8)    =  0.8    clipped
#   t3 ratio 1.1, A -2: max(2.2, 2.2)    =  2.2
#   t4 masked out
# Sum 1.22 over 4 loss tokens.
RATIOS = [1.5, 0.5, 0.5, 1.1, 3.0]
ADV = [1.0, 1.0, -1.0, -2.0, 5.0]
MASK = [1.0, 1.0, 1.0, 1.0, 0.0]


def inputs(
    weights: list[float] | None = None, num_loss_tokens: int = 4, ratios=RATIOS, adv=ADV, mask=MASK
) -> LossInputs:
    logprobs = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros_like(logprobs).detach()
    return LossInputs(
        logprobs=logprobs,
        old_logprobs=zeros,
        rollout_logprobs=zeros,
        advantages=torch.tensor([adv]),
        loss_mask=torch.tensor([mask]),
        correction_weights=None if weights is None else torch.tensor([weights]),
        num_loss_tokens=num_loss_tokens,
    )


def test_loss_metrics_and_gradient() -> None:
    loss_fn = PPOClipLoss()
    assert isinstance(loss_fn, Loss)
    x = inputs()
    out = loss_fn(x)
    assert out.loss.item() == pytest.approx(1.22 / 4)
    assert out.metrics["pg_loss"] == pytest.approx(1.22 / 4)
    assert out.metrics["clipfrac"] == pytest.approx(0.5)
    # k3 per token: ratio - 1 - ln(ratio) = 0.0945349, 0.1931472, 0.1931472, 0.0046898
    assert out.metrics["approx_kl"] == pytest.approx((0.0945349 + 0.1931472 * 2 + 0.0046898) / 4, abs=1e-6)
    out.loss.backward()
    # d/dlogp of -A*ratio where the unclipped term is active (t1, t3), divided by 4; zero elsewhere.
    assert x.logprobs.grad[0].tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 2.2 / 4, 0.0])


def test_token_mean_over_the_global_batch() -> None:
    assert PPOClipLoss()(inputs(num_loss_tokens=10)).loss.item() == pytest.approx(1.22 / 10)


def test_correction_weights_multiply_the_per_token_loss() -> None:
    # -1.28*2 - 0.5*1 + 0.8*0.5 + 2.2*1 = -0.46
    out = PPOClipLoss()(inputs(weights=[2.0, 1.0, 0.5, 1.0, 7.0]))
    assert out.loss.item() == pytest.approx(-0.46 / 4)


def test_dual_clip_bounds_negative_advantages() -> None:
    # ratio 5, A -1: max(5, 1.28) = 5, dual bound -3*A = 3 -> 3.  ratio 5, A +1: max(-5, -1.28) = -1.28 (no dual clip).
    x = inputs(ratios=[5.0, 5.0], adv=[-1.0, 1.0], mask=[1.0, 1.0], num_loss_tokens=2)
    assert PPOClipLoss()(x).loss.item() == pytest.approx((5.0 - 1.28) / 2)
    out = PPOClipLoss(dual_clip=3.0)(x)
    assert out.loss.item() == pytest.approx((3.0 - 1.28) / 2)
    assert out.metrics["dual_clipfrac"] == pytest.approx(0.5)


def test_symmetric_clip_bounds() -> None:
    # clip_low 0.1, clip_high 0.1: t0 max(-1.5, -1.1) = -1.1, t1 max(-0.5, -0.9) = -0.5,
    # t2 max(0.5, 0.9) = 0.9, t3 max(2.2, 2.2) = 2.2 -> 1.5 / 4
    assert PPOClipLoss(clip_low=0.1, clip_high=0.1)(inputs()).loss.item() == pytest.approx(1.5 / 4)


def test_extreme_and_masked_garbage_values_stay_finite() -> None:
    logprobs = torch.tensor([[-1e30, 50.0, -50.0, float("-inf")]], requires_grad=True)
    old = torch.tensor([[0.0, -60.0, 60.0, float("-inf")]])
    x = LossInputs(
        logprobs=logprobs,
        old_logprobs=old,
        rollout_logprobs=old,
        advantages=torch.tensor([[1.0, 1.0, -1.0, float("nan")]]),
        loss_mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        num_loss_tokens=3,
    )
    out = PPOClipLoss()(x)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logprobs.grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_bad_settings_and_shapes() -> None:
    with pytest.raises(ConfigError, match="clip_low"):
        PPOClipLoss(clip_low=1.0)
    with pytest.raises(ConfigError, match="dual_clip must be > 1"):
        PPOClipLoss(dual_clip=0.5)
    x = inputs()
    x.advantages = torch.zeros(1, 3)
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 3\), logprobs \(1, 5\)"):
        PPOClipLoss()(x)
