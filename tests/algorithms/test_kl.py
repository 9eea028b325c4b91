"""kl_estimate: k1/k2/k3 values and gradients by hand, finiteness, and what each one's gradient estimates."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.kl import check_kl_type, kl_estimate
from miles.errors import ConfigError

torch = pytest.importorskip("torch")

INF = float("inf")

# d = logp - ref = [1, -1, 0]
LOGP = [-1.0, -2.0, -0.5]
REF = [-2.0, -1.0, -0.5]
E = math.e


@pytest.mark.parametrize(
    ("kind", "value", "grad"),
    [
        # k1 = d; d/dlogp = 1
        ("k1", [1.0, -1.0, 0.0], [1.0, 1.0, 1.0]),
        # k2 = d^2 / 2 = [0.5, 0.5, 0]; d/dlogp = d
        ("k2", [0.5, 0.5, 0.0], [1.0, -1.0, 0.0]),
        # k3 = exp(-d) + d - 1 = [e^-1 + 0 = 0.3678794, e - 2 = 0.7182818, 0]; d/dlogp = 1 - exp(-d)
        ("k3", [1 / E, E - 2, 0.0], [1 - 1 / E, 1 - E, 0.0]),
    ],
)
def test_values_and_gradients(kind: str, value: list[float], grad: list[float]) -> None:
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    out = kl_estimate(logp, torch.tensor(REF, dtype=torch.float64), kind)  # type: ignore[arg-type]
    assert out.tolist() == pytest.approx(value)
    out.sum().backward()
    assert logp.grad.tolist() == pytest.approx(grad)


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_gradient_pulls_logprobs_toward_the_reference(kind: str) -> None:
    # Descent moves logp against the gradient: down where logp > ref, up where logp < ref.
    logp = torch.tensor([0.0, -3.0], requires_grad=True)
    kl_estimate(logp, torch.tensor([-1.0, -1.0]), kind).sum().backward()  # type: ignore[arg-type]
    assert logp.grad[0] > 0 and logp.grad[1] < 0


def test_extreme_inputs_stay_finite() -> None:
    # d = [1e4, -1e4, -inf, -inf - -inf = nan, +inf] -> clamped to [20, -20, -20, 0, 20]
    logp = torch.tensor([0.0, -1e4, -INF, -INF, 0.0], requires_grad=True)
    ref = torch.tensor([-1e4, 0.0, 0.0, -INF, -INF])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([20.0, -20.0, -20.0, 0.0, 20.0])
    # k3(20) = e^-20 + 19; k3(-20) = e^20 - 21 = 485165174.41
    k3 = kl_estimate(logp, ref, "k3")
    assert k3.tolist() == pytest.approx([19.0, math.exp(20) - 21, math.exp(20) - 21, 0.0, 19.0], rel=1e-6)
    k3.sum().backward()
    # Saturated tokens get no gradient; nothing is nan.
    assert logp.grad.tolist() == [0.0] * 5


def test_low_precision_inputs_are_computed_in_float32() -> None:
    # exp(20) overflows float16 (max 65504); the estimate is computed in float32 instead.
    out = kl_estimate(
        torch.tensor([-30.0], dtype=torch.float16), torch.tensor([0.0], dtype=torch.float16), "k3"
    )
    assert out.dtype == torch.float32 and out.item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


def _exact_grads(kind: str) -> tuple[list[float], list[float], list[float]]:
    """Over a 3-token vocabulary, the exact on-policy expected gradient of the estimate used as a loss,
    E_{x~pi}[grad k(log pi(x), log ref(x))] (pi held fixed as the sampling weight), next to the
    exact gradients of KL(pi || ref) and KL(ref || pi)."""
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.6], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    pi = logp.exp().detach()
    (expected,) = torch.autograd.grad((pi * kl_estimate(logp, ref, kind)).sum(), theta)  # type: ignore[arg-type]
    logp = torch.log_softmax(theta, -1)
    (reverse,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    logp = torch.log_softmax(theta, -1)
    (forward,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)
    return expected.tolist(), reverse.tolist(), forward.tolist()


def test_k2_loss_gradient_is_the_reverse_kl_gradient() -> None:
    # Why the KL loss term defaults to k2: E_pi[(logp - ref) grad logp] = grad KL(pi || ref) exactly.
    expected, reverse, forward = _exact_grads("k2")
    assert expected == pytest.approx(reverse)
    assert expected != pytest.approx(forward)


def test_k3_loss_gradient_is_the_forward_kl_gradient_and_k1_is_zero() -> None:
    # E_pi[(1 - ref/pi) grad logp] = -sum ref grad logp = grad KL(ref || pi); E_pi[grad logp] = 0.
    expected, _, forward = _exact_grads("k3")
    assert expected == pytest.approx(forward)
    assert _exact_grads("k1")[0] == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)


def test_bad_kind_and_shapes() -> None:
    with pytest.raises(ConfigError, match="ppo_clip: kl_type must be one of k1, k2, k3, got 'k4'"):
        check_kl_type("k4", "ppo_clip")
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "low_var_kl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"logprobs has shape \(2,\), ref_logprobs \(3,\)"):
        kl_estimate(torch.zeros(2), torch.zeros(3), "k1")
