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


# ---------------------------------------------------------------- options of issue 5

NAN, INF = float("nan"), float("inf")

# A 2x3 batch, old log-probs 0 so ratio = exp(logprobs); default clip bounds [0.8, 1.28]; the last
# token of row 1 is padding and holds garbage everywhere.
#   row 0: r = [1.0, 1.5, 0.5], A = [+1, +1, +1] -> pg = [-1, max(-1.5, -1.28) = -1.28 clipped, -0.5]
#   row 1: r = [1.1, 2.0, · ],  A = [-1, -1, · ] -> pg = [1.1, max(2.0, 1.28) = 2.0]
# Sum of pg = -1 - 1.28 - 0.5 + 1.1 + 2.0 = 0.32 over N = 5 tokens, S = 2 samples.
# KL: ref = logp - d with d = [1, 0, -1 | 2, 0]; k2 = d^2/2 = [0.5, 0, 0.5 | 2, 0], sum 3.
# Entropy: H = [0.5, 1.0, 1.5 | 2.0, 2.5], sum 7.5.
GRID_RATIOS = [[1.0, 1.5, 0.5], [1.1, 2.0, 1.0]]
GRID_ADV = [[1.0, 1.0, 1.0], [-1.0, -1.0, NAN]]
GRID_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
GRID_D = [[1.0, 0.0, -1.0], [2.0, 0.0, 0.0]]
GRID_H = [[0.5, 1.0, 1.5], [2.0, 2.5, NAN]]


def grid(weights: list[list[float]] | None = None, clean_padding: bool = False) -> LossInputs:
    logprobs = [[math.log(r) for r in row] for row in GRID_RATIOS]
    ref = [
        [lp - d for lp, d in zip(lrow, drow, strict=True)]
        for lrow, drow in zip(logprobs, GRID_D, strict=True)
    ]
    old = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    adv = [row[:] for row in GRID_ADV]
    entropy = [row[:] for row in GRID_H]
    if not clean_padding:  # garbage under mask 0 must change nothing
        logprobs[1][2], old[1][2], ref[1][2] = NAN, -INF, INF
    else:
        adv[1][2] = entropy[1][2] = 0.0
    return LossInputs(
        logprobs=torch.tensor(logprobs, dtype=torch.float64, requires_grad=True),
        old_logprobs=torch.tensor(old, dtype=torch.float64),
        rollout_logprobs=torch.tensor(old, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.tensor(GRID_MASK, dtype=torch.float64),
        correction_weights=None if weights is None else torch.tensor(weights, dtype=torch.float64),
        entropy=torch.tensor(entropy, dtype=torch.float64, requires_grad=True),
        ref_logprobs=torch.tensor(ref, dtype=torch.float64),
        num_loss_tokens=5,
        num_samples=2,
    )


def test_kind_and_requires_follow_the_options() -> None:
    assert PPOClipLoss.kind == "policy"
    assert PPOClipLoss().requires == frozenset()
    assert PPOClipLoss(kl_coef=0.1).requires == frozenset({"ref_logprobs"})
    assert PPOClipLoss(entropy_coef=0.01).requires == frozenset({"entropy"})
    assert PPOClipLoss(kl_coef=0.1, entropy_coef=0.01).requires == frozenset({"ref_logprobs", "entropy"})
    assert PPOClipLoss().kl_type == "k2" and PPOClipLoss().reduction == "token_mean"


@pytest.mark.parametrize("clean_padding", [False, True])
def test_kl_and_entropy_terms_on_a_masked_batch(clean_padding: bool) -> None:
    # loss = 0.32/5 + 0.1 * 3/5 - 0.01 * 7.5/5 = 0.064 + 0.06 - 0.015 = 0.109
    x = grid(clean_padding=clean_padding)
    out = PPOClipLoss(kl_coef=0.1, entropy_coef=0.01)(x)
    assert out.loss.item() == pytest.approx(0.109)
    # approx_kl: r - 1 - ln r = [0, 0.0945349, 0.1931472 | 0.0046898, 0.3068528], sum 0.5992247
    assert out.metrics == pytest.approx(
        {"pg_loss": 0.064, "clipfrac": 0.2, "approx_kl": 0.5992247 / 5, "kl_loss": 0.6, "entropy": 1.5}
    )
    out.loss.backward()
    # pg: -A*r/5 where the unclipped term is active: [-1/5, 0 (clipped), -0.5/5 | 1.1/5, 2.0/5]
    # kl (k2): 0.1 * d / 5 = [0.02, 0, -0.02 | 0.04, 0]
    pg = [-0.2, 0.0, -0.1, 0.22, 0.4, 0.0]
    kl = [0.02, 0.0, -0.02, 0.04, 0.0, 0.0]
    assert x.logprobs.grad.flatten().tolist() == pytest.approx([a + b for a, b in zip(pg, kl, strict=True)])
    # Entropy bonus: d loss / d H = -0.01/5 on loss tokens (descent raises entropy), 0 on padding.
    assert x.entropy.grad.flatten().tolist() == pytest.approx([-0.002] * 5 + [0.0])


def test_sample_mean_weighs_each_sample_equally() -> None:
    # Row sums of pg: row 0 -2.78 over 3 tokens, row 1 3.1 over 2 tokens.
    # sample_mean = (-2.78/3 + 3.1/2) / 2 = (-0.9266667 + 1.55) / 2 = 0.3116667 (token_mean was 0.064).
    x = grid()
    out = PPOClipLoss(reduction="sample_mean")(x)
    assert out.loss.item() == pytest.approx((-2.78 / 3 + 3.1 / 2) / 2)
    out.loss.backward()
    # -A*r / (n_i * S): row 0 / 6, row 1 / 4.
    assert x.logprobs.grad.flatten().tolist() == pytest.approx([-1 / 6, 0.0, -0.5 / 6, 1.1 / 4, 2.0 / 4, 0.0])


@pytest.mark.parametrize(
    ("kl_type", "grads"),
    [
        ("k1", [0.02, 0.02, 0.02, 0.02, 0.02]),  # 0.1 * 1 / 5
        # 0.1 * (1 - exp(-d)) / 5, d = [1, 0, -1, 2, 0]
        ("k3", [0.02 * (1 - 1 / math.e), 0.0, 0.02 * (1 - math.e), 0.02 * (1 - math.exp(-2)), 0.0]),
    ],
)
def test_kl_type_selects_the_estimator(kl_type: str, grads: list[float]) -> None:
    with_kl, without = grid(), grid()
    PPOClipLoss(kl_coef=0.1, kl_type=kl_type)(with_kl).loss.backward()
    PPOClipLoss()(without).loss.backward()
    diff = (with_kl.logprobs.grad - without.logprobs.grad).flatten().tolist()
    assert diff == pytest.approx([*grads, 0.0])


def test_correction_weights_scale_the_policy_gradient_term_only() -> None:
    # w = [2, 1, 1 | 0.5, 0]: pg sum = -2 - 1.28 - 0.5 + 0.55 + 0 = -3.23 -> -0.646; KL and entropy unchanged:
    # -0.646 + 0.06 - 0.015 = -0.601
    out = PPOClipLoss(kl_coef=0.1, entropy_coef=0.01)(grid(weights=[[2.0, 1.0, 1.0], [0.5, 0.0, INF]]))
    assert out.loss.item() == pytest.approx(-0.601)


def test_extreme_log_ratios_with_every_term_on() -> None:
    # Loss tokens with |logp - old| of 1e4 or inf, and -inf - -inf; KL against an extreme reference.
    logprobs = torch.tensor([[1e4, -1e4, -INF], [0.0, -INF, 5.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0], [-INF, -INF, -1e4]])
    entropy = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], requires_grad=True)
    x = LossInputs(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]]),
        loss_mask=torch.ones(2, 3),
        ref_logprobs=torch.tensor([[-1e4, 1e4, 0.0], [INF, -INF, -INF]]),
        entropy=entropy,
        num_loss_tokens=6,
        num_samples=2,
    )
    for reduction in ("token_mean", "sample_mean"):
        logprobs.grad = entropy.grad = None
        out = PPOClipLoss(kl_coef=1.0, kl_type="k3", entropy_coef=0.1, dual_clip=3.0, reduction=reduction)(x)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert torch.isfinite(logprobs.grad).all() and torch.isfinite(entropy.grad).all()
        assert all(math.isfinite(v) for v in out.metrics.values())


def test_missing_optional_inputs_and_bad_options() -> None:
    x = inputs()
    with pytest.raises(ValueError, match="ppo_clip: LossInputs is missing ref_logprobs"):
        PPOClipLoss(kl_coef=0.1)(x)
    with pytest.raises(ValueError, match="ppo_clip: LossInputs is missing entropy"):
        PPOClipLoss(entropy_coef=0.1)(x)
    with pytest.raises(ConfigError, match="kl_type must be one of k1, k2, k3"):
        PPOClipLoss(kl_type="low_var_kl")
    with pytest.raises(ConfigError, match="reduction must be one of token_mean, sample_mean"):
        PPOClipLoss(reduction="seq_mean")
    with pytest.raises(ConfigError, match="kl_coef must be >= 0"):
        PPOClipLoss(kl_coef=-0.1)
    with pytest.raises(ConfigError, match="entropy_coef must be a finite number"):
        PPOClipLoss(entropy_coef=float("nan"))
    with pytest.raises(ConfigError, match=r"clip_high must be a finite number, got '0\.3'"):
        PPOClipLoss(clip_high="0.3")  # type: ignore[arg-type]
