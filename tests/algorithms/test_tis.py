"""TruncatedIS against hand-computed ratios; finite under extreme inputs."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.tis import TruncatedIS
from miles.errors import ConfigError
from miles.interfaces import Correction

torch = pytest.importorskip("torch")


def test_weights_and_metrics() -> None:
    # log r = old - rollout = 0.5, -1.0, 0.0, (masked) -> r = 1.6487213, 0.3678794, 1.0
    old = torch.tensor([[-1.0, -2.0, -0.5, -9.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -1.0, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    tis = TruncatedIS(low=0.5, high=1.5)
    assert isinstance(tis, Correction)
    out = tis(old, rollout, mask)
    assert out.weights.tolist()[0] == pytest.approx([1.5, 0.5, 1.0, 1.0])
    assert not out.weights.requires_grad
    assert out.metrics["correction/ratio_mean"] == pytest.approx((1.6487213 + 0.3678794 + 1.0) / 3)
    assert out.metrics["correction/clipped_frac"] == pytest.approx(2 / 3)
    assert out.metrics["correction/abs_dev"] == pytest.approx((0.6487213 + 0.6321206) / 3)


def test_default_bounds_keep_ratios_up_to_two() -> None:
    old = torch.tensor([[math.log(1.7), math.log(0.2), math.log(3.0)]])
    out = TruncatedIS()(old, torch.zeros(1, 3), torch.ones(1, 3))
    assert out.weights.tolist()[0] == pytest.approx([1.7, 0.2, 2.0])
    assert out.metrics["correction/clipped_frac"] == pytest.approx(1 / 3)


def test_extreme_inputs_stay_finite() -> None:
    inf = float("inf")
    old = torch.tensor([[-inf, 0.0, -inf, 1e30, -1e30]])
    rollout = torch.tensor([[0.0, -inf, -inf, -1e30, 1e30]])
    out = TruncatedIS()(old, rollout, torch.ones(1, 5))
    assert torch.isfinite(out.weights).all()
    assert out.weights.tolist()[0] == pytest.approx([math.exp(-20), 2.0, 1.0, 2.0, math.exp(-20)])
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_bad_bounds_and_shapes() -> None:
    with pytest.raises(ConfigError, match="0 <= low < high"):
        TruncatedIS(low=2.0, high=1.0)
    with pytest.raises(ValueError, match="shapes differ"):
        TruncatedIS()(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def test_masked_tokens_keep_weight_one_whatever_the_interval() -> None:
    # With [1.5, 3] a masked token (ratio 1 after masking) is still weight 1, not clamped up to 1.5;
    # the loss token r = 1 is pulled up to 1.5.
    out = TruncatedIS(low=1.5, high=3.0)(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]))
    assert out.weights.tolist()[0] == pytest.approx([1.5, 1.0])


def test_by_name() -> None:
    from miles.plugins import make_component

    corr = make_component("correction", "tis", {"high": 3.0})
    assert isinstance(corr, TruncatedIS) and (corr.low, corr.high) == (0.0, 3.0)
