"""GSPOLoss: the sequence-level ratio, its GSPO-token gradient, tiny clip bounds and sample-mean reduction."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.ppo_clip import GSPOLoss, PPOClipLoss
from miles.errors import ConfigError
from miles.interfaces import Loss, LossInputs
from miles.plugins import make_component

torch = pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")

# old log-probs 0, so logp - old = logp. Last token of row 1 is padding (garbage).
#   row 0: log-ratios [0.3, -0.1, 0.1], mean 0.1  -> s_0 = e^0.1  = 1.1051709, A = +1
#   row 1: log-ratios [0.2, -0.4, ·],   mean -0.1 -> s_1 = e^-0.1 = 0.9048374, A = -2
LOG_RATIOS = [[0.3, -0.1, 0.1], [0.2, -0.4, 99.0]]
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, NAN]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
S0, S1 = math.exp(0.1), math.exp(-0.1)
WIDE = {"clip_low": 0.5, "clip_high": 0.5}  # [0.5, 1.5]: nothing clipped


def batch(log_ratios=LOG_RATIOS, adv=ADV, mask=MASK, old_pad: float = -INF) -> LossInputs:
    old = [[0.0] * 3, [0.0, 0.0, old_pad]]
    return LossInputs(
        logprobs=torch.tensor(log_ratios, dtype=torch.float64, requires_grad=True),
        old_logprobs=torch.tensor(old, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.tensor(mask, dtype=torch.float64),
        num_loss_tokens=5,
        num_samples=2,
    )


def test_defaults_by_name() -> None:
    loss = make_component("loss", "gspo", {})
    assert isinstance(loss, GSPOLoss) and isinstance(loss, Loss)
    assert (loss.clip_low, loss.clip_high, loss.reduction, loss.kind) == (3e-4, 4e-4, "sample_mean", "policy")
    assert loss.requires == frozenset()


def test_unclipped_loss_and_per_token_gradient() -> None:
    # pg per token = -A * s_i: row 0 -1.1051709, row 1 +1.8096748.
    # sample_mean = (-1.1051709 + 1.8096748) / 2 = 0.3522520
    x = batch()
    out = GSPOLoss(**WIDE)(x)
    assert out.loss.item() == pytest.approx((-S0 + 2 * S1) / 2)
    assert out.metrics["clipfrac"] == 0.0
    out.loss.backward()
    # Each token gets -A * s_i / (|y_i| * S): row 0 -1.1051709/6 = -0.1841952, row 1 1.8096748/4 = 0.4524187.
    assert x.logprobs.grad.flatten().tolist() == pytest.approx(
        [-S0 / 6, -S0 / 6, -S0 / 6, 2 * S1 / 4, 2 * S1 / 4, 0.0]
    )


def test_gradient_matches_the_sequence_level_objective() -> None:
    # Sequence-level GSPO: J = sum_i -A_i * exp(mean_t logp_it - old_it) / S, differentiated through s_i itself.
    x = batch()
    GSPOLoss(**WIDE)(x).loss.backward()
    logp = x.logprobs.detach().clone().requires_grad_(True)
    s0 = torch.exp(logp[0].mean())
    s1 = torch.exp(logp[1, :2].mean())
    ((-1.0 * s0 + 2.0 * s1) / 2).backward()
    assert x.logprobs.grad.flatten().tolist() == pytest.approx(logp.grad.flatten().tolist())


def test_token_mean_weighs_samples_by_length() -> None:
    # token_mean = (3 * -1.1051709 + 2 * 1.8096748) / 5 = 0.3038369 / 5 = 0.0607674; gradient -A * s_i / 5.
    x = batch()
    out = GSPOLoss(reduction="token_mean", **WIDE)(x)
    assert out.loss.item() == pytest.approx((-3 * S0 + 4 * S1) / 5)
    out.loss.backward()
    assert x.logprobs.grad.flatten().tolist() == pytest.approx([-S0 / 5] * 3 + [2 * S1 / 5] * 2 + [0.0])


def test_default_bounds_clip_whole_sequences() -> None:
    # Bounds [1 - 3e-4, 1 + 4e-4] = [0.9997, 1.0004].
    #   row 0: log-ratios [1e-4, -1e-4, 3e-4], mean 1e-4 -> s_0 = e^1e-4 = 1.000100005 inside: pg = -s_0
    #   row 1: s_1 = e^-0.1 = 0.9048 < 0.9997, A = -2: max(1.8096748, 2 * 0.9997 = 1.9994) = 1.9994, clipped
    # loss = (-1.000100005 + 1.9994) / 2 = 0.4996500; clipfrac = 2 tokens of 5.
    s0 = math.exp(1e-4)
    x = batch(log_ratios=[[1e-4, -1e-4, 3e-4], [0.2, -0.4, 99.0]])
    out = GSPOLoss()(x)
    assert out.loss.item() == pytest.approx((-s0 + 1.9994) / 2)
    assert out.metrics["clipfrac"] == pytest.approx(0.4)
    out.loss.backward()
    # Row 0 unclipped: -s_0 / (3 * 2); row 1 clipped: no gradient.
    assert x.logprobs.grad.flatten().tolist() == pytest.approx([-s0 / 6] * 3 + [0.0] * 3)


def test_approx_kl_is_per_token() -> None:
    # r - 1 - ln r of the token ratios: 0.3 -> 0.0498588, -0.1 -> 0.0048374, 0.1 -> 0.0051709,
    # 0.2 -> 0.0214028, -0.4 -> 0.0703200; sum 0.1515899 over 5 tokens.
    assert GSPOLoss(**WIDE)(batch()).metrics["approx_kl"] == pytest.approx(0.1515899 / 5, abs=1e-7)


def test_padding_garbage_changes_nothing() -> None:
    clean = batch(
        log_ratios=[[0.3, -0.1, 0.1], [0.2, -0.4, 0.0]], adv=[[1.0] * 3, [-2.0, -2.0, 0.0]], old_pad=0.0
    )
    dirty = batch(log_ratios=[[0.3, -0.1, 0.1], [0.2, -0.4, NAN]], adv=[[1.0] * 3, [-2.0, -2.0, INF]])
    a, b = GSPOLoss(**WIDE)(clean), GSPOLoss(**WIDE)(dirty)
    assert a.loss.item() == pytest.approx(b.loss.item())
    a.loss.backward()
    b.loss.backward()
    assert dirty.logprobs.grad.flatten().tolist() == pytest.approx(clean.logprobs.grad.flatten().tolist())


def test_micro_batches_add_up_to_the_whole_batch() -> None:
    # Each row is a whole sample, so s_i is the same whichever micro-batch holds the row.
    whole = GSPOLoss(**WIDE)(batch()).loss.item()
    x = batch()
    parts = [
        LossInputs(
            logprobs=x.logprobs[rows],
            old_logprobs=x.old_logprobs[rows],
            advantages=x.advantages[rows],
            loss_mask=x.loss_mask[rows],
            num_loss_tokens=5,
            num_samples=2,
        )
        for rows in (slice(0, 1), slice(1, 2))
    ]
    assert sum(GSPOLoss(**WIDE)(p).loss.item() for p in parts) == pytest.approx(whole)


def test_extreme_log_ratios_stay_finite() -> None:
    logprobs = torch.tensor([[1e4, -1e4, -INF], [0.0, -INF, 5.0]], requires_grad=True)
    x = LossInputs(
        logprobs=logprobs,
        old_logprobs=torch.tensor([[0.0, 0.0, 0.0], [-INF, -INF, -1e4]]),
        advantages=torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]),
        loss_mask=torch.ones(2, 3),
        entropy=torch.ones(2, 3, requires_grad=True),
        ref_logprobs=torch.tensor([[-1e4, 1e4, 0.0], [INF, -INF, -INF]]),
        num_loss_tokens=6,
        num_samples=2,
    )
    out = GSPOLoss(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0, **WIDE)(x)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logprobs.grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_shares_ppo_options_and_validation() -> None:
    assert issubclass(GSPOLoss, PPOClipLoss)
    assert GSPOLoss(kl_coef=0.1).requires == frozenset({"ref_logprobs"})
    with pytest.raises(ConfigError, match="gspo: clip_low must be in"):
        GSPOLoss(clip_low=-1e-4)
    with pytest.raises(ConfigError, match="gspo: reduction must be one of"):
        GSPOLoss(reduction="seq")
