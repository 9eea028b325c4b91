"""ClippedValueLoss against values computed by hand from the formula."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.value import ClippedValueLoss
from miles.errors import ConfigError
from miles.interfaces import Loss, LossInputs
from miles.plugins import make_component

torch = pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")

# clip c = 0.2; per token 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)
#   (0,0) V 1.0 V_old 0.9 R 1.5: (-0.5)^2 = 0.25; clip -> 1.0 (inside [0.7, 1.1]), 0.25   -> 0.125 (tie)
#   (0,1) V 0.5 V_old 0.0 R 0.0: 0.25; clip -> 0.2, 0.04                                  -> 0.125
#   (0,2) V 2.0 V_old 2.0 R 1.0: 1.0;  clip -> 2.0, 1.0                                    -> 0.5   (tie)
#   (1,0) V 0.0 V_old 1.0 R 0.5: 0.25; clip -> 0.8, 0.09                                   -> 0.125
#   (1,1) V 3.0 V_old 2.5 R 3.6: 0.36; clip -> 2.7, (2.7 - 3.6)^2 = 0.81, clipped wins     -> 0.405
#   (1,2) padding
# Sum 1.28 over N = 5 tokens -> 0.256; sample_mean = (0.75/3 + 0.53/2) / 2 = (0.25 + 0.265) / 2 = 0.2575.
V = [[1.0, 0.5, 2.0], [0.0, 3.0, NAN]]
V_OLD = [[0.9, 0.0, 2.0], [1.0, 2.5, INF]]
R = [[1.5, 0.0, 1.0], [0.5, 3.6, -INF]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def batch(values=V, old=V_OLD, returns=R) -> LossInputs:
    return LossInputs(
        values=torch.tensor(values, dtype=torch.float64, requires_grad=True),
        old_values=torch.tensor(old, dtype=torch.float64),
        returns=torch.tensor(returns, dtype=torch.float64),
        loss_mask=torch.tensor(MASK, dtype=torch.float64),
        num_loss_tokens=5,
        num_samples=2,
    )


def test_by_name_with_the_critic_options() -> None:
    loss = make_component("loss", "value_clip", {"clip": 0.5})
    assert isinstance(loss, ClippedValueLoss) and isinstance(loss, Loss)
    assert (loss.kind, loss.clip, loss.reduction, loss.requires) == ("value", 0.5, "token_mean", frozenset())
    assert ClippedValueLoss().clip == 0.2


def test_loss_metrics_and_gradient() -> None:
    x = batch()
    out = ClippedValueLoss()(x)
    assert out.loss.item() == pytest.approx(0.256)
    # values_mean = (1 + 0.5 + 2 + 0 + 3) / 5 = 1.3; returns_mean = (1.5 + 0 + 1 + 0.5 + 3.6) / 5 = 1.32
    assert out.metrics == pytest.approx(
        {"value_loss": 0.256, "value_clipfrac": 0.2, "values_mean": 1.3, "returns_mean": 1.32}
    )
    out.loss.backward()
    # d/dV of 0.5 (V - R)^2 = V - R on the active branch, / 5; the clipped winner (1,1) is outside its
    # clip range so it gets 0; ties inside the range get V - R either way; padding 0.
    assert x.values.grad.flatten().tolist() == pytest.approx([-0.1, 0.1, 0.2, -0.1, 0.0, 0.0])


def test_sample_mean() -> None:
    assert ClippedValueLoss(reduction="sample_mean")(batch()).loss.item() == pytest.approx(0.2575)


def test_no_clip_is_half_the_squared_error() -> None:
    # 0.5 * [0.25, 0.25, 1.0, 0.25, 0.36] = [0.125, 0.125, 0.5, 0.125, 0.18], sum 1.055 -> 0.211
    out = ClippedValueLoss(clip=None)(batch())
    assert out.loss.item() == pytest.approx(0.211)
    assert out.metrics["value_clipfrac"] == 0.0


def test_padding_garbage_changes_nothing() -> None:
    clean = batch(
        values=[[1.0, 0.5, 2.0], [0.0, 3.0, 0.0]],
        old=[[0.9, 0.0, 2.0], [1.0, 2.5, 0.0]],
        returns=[[1.5, 0.0, 1.0], [0.5, 3.6, 0.0]],
    )
    dirty = batch()
    a, b = ClippedValueLoss()(clean), ClippedValueLoss()(dirty)
    assert a.loss.item() == pytest.approx(b.loss.item())
    a.loss.backward()
    b.loss.backward()
    assert dirty.values.grad.flatten().tolist() == pytest.approx(clean.values.grad.flatten().tolist())
    assert all(math.isfinite(v) for v in b.metrics.values())


def test_missing_inputs_and_bad_options() -> None:
    x = batch()
    x.old_values = None
    with pytest.raises(ValueError, match="value_clip: LossInputs is missing old_values"):
        ClippedValueLoss()(x)
    x = batch()
    x.returns = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"returns has shape \(2, 2\), values \(2, 3\)"):
        ClippedValueLoss()(x)
    for bad in (0.0, -0.2, float("inf"), "0.2", True):
        with pytest.raises(ConfigError, match="value_clip: clip must be a number > 0"):
            ClippedValueLoss(clip=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="value_clip: reduction must be one of"):
        ClippedValueLoss(reduction="sum")
