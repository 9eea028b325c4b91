"""SFTLoss: masked negative log-likelihood, both reductions, metrics."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.sft import SFTLoss
from miles.errors import ConfigError
from miles.interfaces import Loss, LossInputs
from miles.plugins import make_component

torch = pytest.importorskip("torch")

NAN = float("nan")

# row 0: logp [-1, -2, ·] (padding holds nan), n = 2, NLL sum 3
# row 1: logp [-0.5, -0.5, -2], n = 3, NLL sum 3
# token_mean = 6 / 5 = 1.2; sample_mean = (3/2 + 3/3) / 2 = 1.25
LOGP = [[-1.0, -2.0, NAN], [-0.5, -0.5, -2.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def batch(logp=LOGP) -> LossInputs:
    return LossInputs(
        logprobs=torch.tensor(logp, dtype=torch.float64, requires_grad=True),
        loss_mask=torch.tensor(MASK),
        num_loss_tokens=5,
        num_samples=2,
    )


def test_by_name() -> None:
    loss = make_component("loss", "sft", {})
    assert isinstance(loss, SFTLoss) and isinstance(loss, Loss)
    assert (loss.kind, loss.reduction, loss.requires) == ("supervised", "token_mean", frozenset())


def test_token_mean_loss_metrics_and_gradient() -> None:
    x = batch()
    out = SFTLoss()(x)
    assert out.loss.item() == pytest.approx(1.2)
    # nll = 1.2, ppl = e^1.2 = 3.3201169
    assert out.metrics == pytest.approx({"nll": 1.2, "ppl": math.exp(1.2)})
    out.loss.backward()
    # d/dlogp = -1/5 on every loss token, 0 on padding (not nan).
    assert x.logprobs.grad.flatten().tolist() == pytest.approx([-0.2, -0.2, 0.0, -0.2, -0.2, -0.2])


def test_sample_mean_weighs_each_example_equally() -> None:
    x = batch()
    out = SFTLoss(reduction="sample_mean")(x)
    assert out.loss.item() == pytest.approx(1.25)
    out.loss.backward()
    # -1 / (n_i * S): row 0 -1/4, row 1 -1/6.
    assert x.logprobs.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 0.0, -1 / 6, -1 / 6, -1 / 6])


def test_very_unlikely_tokens_stay_finite() -> None:
    # (1e4 + 2 + 0.5 + 0.5 + 2) / 5 = 2001; ppl is capped at e^80 rather than overflowing.
    x = batch(logp=[[-1e4, -2.0, NAN], [-0.5, -0.5, -2.0]])
    out = SFTLoss()(x)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(2001.0)
    assert out.metrics["ppl"] == pytest.approx(math.exp(80))
    assert torch.isfinite(x.logprobs.grad).all()


def test_missing_inputs_and_bad_options() -> None:
    with pytest.raises(ConfigError, match="sft: reduction must be one of token_mean, sample_mean"):
        SFTLoss(reduction="mean")
    with pytest.raises(ValueError, match="sft: LossInputs is missing logprobs"):
        SFTLoss()(LossInputs(loss_mask=torch.ones(1, 2)))
    with pytest.raises(ValueError, match=r"sft: loss_mask has shape \(1, 2\), logprobs \(2, 3\)"):
        SFTLoss()(LossInputs(loss_mask=torch.ones(1, 2), logprobs=torch.zeros(2, 3)))
