"""Truncated importance sampling: corrects for the engine sampling with slightly different numerics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.errors import ConfigError
from miles.interfaces import CorrectionOutput

if TYPE_CHECKING:
    import torch

# exp(20) is about 5e8: far beyond any truncation bound, and finite in float32.
LOG_RATIO_LIMIT = 20.0


class TruncatedIS:
    """Per-token weights ``clamp(exp(old_logprobs - rollout_logprobs), low, high)``, detached.

    The ratio compares the trainer's log-probs of the sampled tokens with the engine's.
    Masked tokens get weight 1 and are left out of the metrics, which are masked means:
    ``correction/ratio_mean`` (before truncation), ``correction/clipped_frac`` (tokens
    outside ``[low, high]``) and ``correction/abs_dev`` (mean ``|ratio - 1|``).
    """

    def __init__(self, low: float = 0.0, high: float = 2.0) -> None:
        if not (low >= 0 and high > low):
            raise ConfigError(f"tis: need 0 <= low < high, got low={low!r} high={high!r}")
        self.low = low
        self.high = high

    def __call__(
        self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
    ) -> CorrectionOutput:
        import torch

        with torch.no_grad():
            if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != loss_mask.shape:
                raise ValueError(
                    f"tis: shapes differ: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                    f"{tuple(rollout_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}"
                )
            mask = loss_mask.float()
            keep = mask > 0
            log_ratio = old_logprobs.float() - rollout_logprobs.float()
            # -inf - -inf is nan; +-inf saturates at the limit. Masked tokens become ratio 1.
            log_ratio = torch.nan_to_num(log_ratio, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)
            log_ratio = torch.where(
                keep, log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), torch.zeros_like(log_ratio)
            )
            ratio = torch.exp(log_ratio)
            weights = ratio.clamp(self.low, self.high)
            n = mask.sum().clamp(min=1.0)
            metrics = {
                "correction/ratio_mean": float((ratio * mask).sum() / n),
                "correction/clipped_frac": float(
                    (((ratio < self.low) | (ratio > self.high)).float() * mask).sum() / n
                ),
                "correction/abs_dev": float(((ratio - 1.0).abs() * mask).sum() / n),
            }
        return CorrectionOutput(weights=weights, metrics=metrics)
