"""Corrections for train/rollout mismatch: per-token weights from the trainer-vs-engine ratio.

The engine samples with slightly different numerics (kernels, precision, batching) from the
trainer, so even on-policy tokens have ``r = exp(old_logprobs − rollout_logprobs) ≠ 1``.
Both corrections bound the weight that ratio puts on a token's policy-gradient loss, and
report the same metrics; they differ in what happens outside ``[low, high]``:

- ``tis`` (:class:`TruncatedIS`) clamps: an outlier token is damped to the bound.
- ``clip_or_pop`` (:class:`ClipOrPop`) pops: an outlier token gets weight 0, as if masked.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.interfaces import CorrectionOutput

if TYPE_CHECKING:
    import torch

# exp(20) is about 5e8: far beyond any truncation bound, and finite in float32.
LOG_RATIO_LIMIT = 20.0


class RatioOptions(ComponentOptions):
    low: float = Field(0.0, description="lower bound of the trusted ratio range (>= 0)")
    high: float = Field(2.0, description="upper bound of the trusted ratio range (> low)")


class _RatioCorrection(abc.ABC):
    """Shared body: the clamped ratio, its metrics, and weights from ``_weights``.

    ``r = exp(clamp(old_logprobs − rollout_logprobs, −20, 20))`` per token; ``±inf`` saturates
    at the bound and ``−inf − −inf`` (nan) counts as ``r = 1``. Weights are detached, and 1
    on masked tokens. Metrics are masked means over the loss tokens:
    ``correction/ratio_mean`` (``r`` before the weight is applied), ``correction/clipped_frac``
    (tokens with ``r`` outside ``[low, high]``) and ``correction/abs_dev`` (``|r − 1|``).
    """

    name = "correction"
    Options = RatioOptions

    def __init__(self, low: float = 0.0, high: float = 2.0) -> None:
        if not (low >= 0 and high > low):
            raise ConfigError(f"{self.name}: need 0 <= low < high, got low={low!r} high={high!r}")
        self.low = low
        self.high = high

    @abc.abstractmethod
    def _weights(self, ratio: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        """Per-token weights from the ratio; ``outside`` marks ratios outside ``[low, high]``."""

    def __call__(
        self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
    ) -> CorrectionOutput:
        import torch

        with torch.no_grad():
            if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != loss_mask.shape:
                raise ValueError(
                    f"{self.name}: shapes differ: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                    f"{tuple(rollout_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}"
                )
            mask = loss_mask.float()
            keep = mask > 0
            log_ratio = old_logprobs.float() - rollout_logprobs.float()
            log_ratio = torch.nan_to_num(log_ratio, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)
            log_ratio = torch.where(
                keep, log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), torch.zeros_like(log_ratio)
            )
            ratio = torch.exp(log_ratio)
            outside = (ratio < self.low) | (ratio > self.high)
            weights = torch.where(keep, self._weights(ratio, outside), torch.ones_like(ratio))
            n = mask.sum().clamp(min=1.0)
            metrics = {
                "correction/ratio_mean": float((ratio * mask).sum() / n),
                "correction/clipped_frac": float((outside.float() * mask).sum() / n),
                "correction/abs_dev": float(((ratio - 1.0).abs() * mask).sum() / n),
            }
        return CorrectionOutput(weights=weights, metrics=metrics)


class TruncatedIS(_RatioCorrection):
    """Truncated importance sampling: weight ``clamp(r, low, high)``, default ``[0, 2]``.

    With the default a ratio can only be pulled down (none is below 0): an over-weighted
    token is damped to 2 rather than dropped. Metrics as described in ``_RatioCorrection``.
    """

    name = "tis"

    def _weights(self, ratio: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        return ratio.clamp(self.low, self.high)


class ClipOrPop(_RatioCorrection):
    """Clip-or-pop: weight ``r`` where ``low <= r <= high``, else 0 (the token is popped), default ``[0, 2]``.

    A popped token drops out of the policy-gradient numerator exactly as a masked token
    would, while the loss's denominator (the batch's loss-token or sample count) is
    unchanged. ``correction/clipped_frac`` is the popped fraction.
    """

    name = "clip_or_pop"

    def _weights(self, ratio: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.where(outside, torch.zeros_like(ratio), ratio)
