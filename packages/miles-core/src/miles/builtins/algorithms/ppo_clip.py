"""The PPO clipped policy-gradient loss (asymmetric "clip-higher" bounds, optional dual clip)."""

from __future__ import annotations

from miles.errors import ConfigError
from miles.interfaces import LossInputs, LossOutput

# exp(20) is about 5e8: far beyond any clip bound, and finite in every float type we train in.
LOG_RATIO_LIMIT = 20.0


class PPOClipLoss:
    """``-min(ratio·A, clip(ratio, 1-clip_low, 1+clip_high)·A)`` per token, ratio = exp(logprobs - old_logprobs).

    With ``dual_clip = c`` (> 1), tokens with ``A < 0`` are further bounded by ``-c·A``.
    Correction weights (e.g. TIS) multiply the per-token loss. The masked sum is divided by
    ``num_loss_tokens``, the loss-token count of the whole global batch, so summing the
    micro-batch losses gives the token mean over the global batch.

    Metrics are masked means over this micro-batch's loss tokens (combine micro-batches
    weighted by their ``loss_mask`` sums): ``pg_loss`` (the per-token loss),
    ``clipfrac`` (tokens where the clipped term won), ``approx_kl`` (k3 estimate of
    KL(old || current): ``ratio - 1 - log ratio``), and ``dual_clipfrac`` when dual clip is on.
    """

    def __init__(
        self, clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = None
    ) -> None:
        if not 0 <= clip_low < 1:
            raise ConfigError(f"ppo_clip: clip_low must be in [0, 1), got {clip_low!r}")
        if not clip_high >= 0:
            raise ConfigError(f"ppo_clip: clip_high must be >= 0, got {clip_high!r}")
        if dual_clip is not None and not dual_clip > 1:
            raise ConfigError(f"ppo_clip: dual_clip must be > 1 (or null to disable), got {dual_clip!r}")
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dual_clip = dual_clip

    def __call__(self, inputs: LossInputs) -> LossOutput:
        import torch

        logprobs = inputs.logprobs.float()
        shape = logprobs.shape
        for name in ("old_logprobs", "advantages", "loss_mask"):
            if getattr(inputs, name).shape != shape:
                raise ValueError(
                    f"ppo_clip: {name} has shape {tuple(getattr(inputs, name).shape)}, logprobs {tuple(shape)}"
                )
        mask = inputs.loss_mask.float()
        keep = mask > 0
        # Padding may hold anything (even -inf); zero it so nothing non-finite enters the graph.
        log_ratio = torch.where(
            keep, logprobs - inputs.old_logprobs.float().detach(), torch.zeros_like(logprobs)
        )
        log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        adv = torch.where(keep, inputs.advantages.float().detach(), torch.zeros_like(logprobs))
        ratio = torch.exp(log_ratio)

        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        per_token = torch.maximum(unclipped, clipped)
        dual_active = None
        if self.dual_clip is not None:
            bound = -adv * self.dual_clip
            dual_active = (adv < 0) & (per_token > bound)
            per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
        if inputs.correction_weights is not None:
            weights = inputs.correction_weights
            if weights.shape != shape:
                raise ValueError(
                    f"ppo_clip: correction_weights has shape {tuple(weights.shape)}, logprobs {tuple(shape)}"
                )
            per_token = per_token * weights.float().detach()

        per_token = per_token * mask
        loss = per_token.sum() / max(int(inputs.num_loss_tokens), 1)

        with torch.no_grad():
            n = mask.sum().clamp(min=1.0)
            metrics = {
                "pg_loss": float(per_token.sum() / n),
                "clipfrac": float(((clipped > unclipped).float() * mask).sum() / n),
                "approx_kl": float(((ratio - 1.0 - log_ratio) * mask).sum() / n),
            }
            if dual_active is not None:
                metrics["dual_clipfrac"] = float((dual_active.float() * mask).sum() / n)
        return LossOutput(loss=loss, metrics=metrics)
