"""The Flow-GRPO objective: group-relative advantages and a clipped ratio loss per denoising step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class FlowGRPOConfig:
    name: ClassVar[str] = "flow_grpo"
    guidance: ClassVar[str | None] = None
    """Flow-GRPO re-scores each recorded step with the sampler's own guided velocity: any scale runs."""

    clip_range: float = 1e-3
    """The ratio is clipped to [1 - clip_range, 1 + clip_range] (log-probs are per-pixel means)."""
    kl_coef: float = 0.0
    """Weight of the KL to the frozen starting model; 0 builds no reference model."""
    adv_clip_max: float = 5.0
    eps: float = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Standardise rewards within each group of ``group_size`` consecutive samples (one prompt each).

    ``rewards``: [B] with ``B % group_size == 0``. A group whose rewards are all equal gets zeros.
    """
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    return ((grouped - mean) / (std + eps)).view(-1)


@dataclass(frozen=True)
class StepLoss:
    loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl_old: torch.Tensor
    kl_ref: torch.Tensor


def flow_grpo_step_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    config: FlowGRPOConfig,
    kl_ref: torch.Tensor | None = None,
) -> StepLoss:
    """PPO-style clipped loss for one denoising step over a batch, all inputs [B].

    ``kl_ref`` is the per-sample KL to the reference policy at this step (for two Gaussians with one
    std it is ``|mean - mean_ref|^2 / (2 std^2)``), added with weight ``kl_coef``.
    """
    adv = advantages.clamp(-config.adv_clip_max, config.adv_clip_max)
    ratio = torch.exp(new_log_prob - old_log_prob)
    clipped = ratio.clamp(1.0 - config.clip_range, 1.0 + config.clip_range)
    policy_loss = torch.maximum(-adv * ratio, -adv * clipped).mean()
    kl = kl_ref.mean() if kl_ref is not None else torch.zeros((), dtype=policy_loss.dtype)
    loss = policy_loss + config.kl_coef * kl
    with torch.no_grad():
        clip_fraction = ((ratio - 1.0).abs() > config.clip_range).float().mean()
        approx_kl_old = 0.5 * ((new_log_prob - old_log_prob) ** 2).mean()
    return StepLoss(loss, clip_fraction, approx_kl_old, kl.detach())
