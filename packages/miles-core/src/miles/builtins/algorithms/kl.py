"""Per-token estimators of KL(π ‖ π_ref) from the log-probabilities of the sampled tokens.

With tokens sampled from π and ``d = log π(x) − log π_ref(x)``, three estimators are in use
(Schulman, "Approximating KL Divergence", 2020):

- ``k1 = d``: unbiased for the KL value, high variance, negative on some tokens.
- ``k2 = ½·d²``: biased for the value, always >= 0. As a loss term its on-policy gradient
  ``E_π[d·∇log π]`` is exactly ``∇ KL(π ‖ π_ref)``.
- ``k3 = exp(−d) + d − 1``: unbiased for the value, always >= 0, low variance (the GRPO
  paper's choice). As a loss term its on-policy gradient is ``∇ KL(π_ref ‖ π)``, the
  forward KL.

The same function serves a KL loss term and the driver's reward shaping (REINFORCE++, PPO).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from miles.errors import ConfigError

if TYPE_CHECKING:
    import torch

KLType = Literal["k1", "k2", "k3"]
KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3")

# Bound on |log π − log π_ref| before the estimate: exp(20) ≈ 4.9e8 keeps k3 and its gradient
# finite in float32, and a token 20 nats apart is already far outside any sane trust region.
LOG_RATIO_LIMIT = 20.0


def check_kl_type(kind: object, who: str) -> KLType:
    """Validate a recipe's ``kl_type`` option at construction time (``who`` names the component)."""
    if kind not in KL_TYPES:
        raise ConfigError(f"{who}: kl_type must be one of {', '.join(KL_TYPES)}, got {kind!r}")
    return kind  # type: ignore[return-value]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token KL estimate of the sampled tokens, same shape as ``logprobs``.

    ``d = clamp(logprobs − ref_logprobs, −20, 20)`` (an infinite difference saturates at the
    bound; ``−inf − −inf``, a token both policies rule out, counts as ``d = 0``), then
    ``k1 = d``, ``k2 = ½·d²``, ``k3 = exp(−d) + d − 1`` (written with ``ref − logp`` as
    ``exp(ref − logp) − (ref − logp) − 1``). The result is always finite. It is
    differentiable w.r.t. ``logprobs`` (and ``ref_logprobs``); where the clamp is active the
    gradient is 0. Computed in at least float32, so bf16 inputs do not overflow ``exp``.
    Masking is the caller's business: every position gets an estimate.
    """
    import torch

    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_estimate: logprobs has shape {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, ref_logprobs.dtype), torch.float32)
    diff = logprobs.to(dtype) - ref_logprobs.to(dtype)
    # nan_to_num's gradient is 0 where it replaced a value, so a non-finite token adds no gradient.
    diff = torch.nan_to_num(diff, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)
    diff = diff.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        # expm1(−d) + d = exp(−d) − 1 + d, accurate near d = 0 where the terms nearly cancel.
        return torch.expm1(-diff) + diff
    raise ValueError(f"kl_estimate: kind must be one of {', '.join(KL_TYPES)}, got {kind!r}")
