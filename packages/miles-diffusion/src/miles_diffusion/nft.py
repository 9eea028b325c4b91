"""DiffusionNFT: negative-aware fine-tuning of a flow model on the forward (noising) process.

Flow-GRPO trains on the reverse process: it re-scores the log-probability of recorded SDE steps.
DiffusionNFT needs no log-probabilities and no particular sampler. It takes the clean images the
current policy sampled, noises them again with the forward process ``x_t = (1 - t) x_0 + t eps``
at fresh noise levels, and regresses the velocity target ``eps - x_0`` with two implicit policies
built from the trainable velocity ``v`` and the sampling policy's velocity ``v_old`` (frozen for
the iteration):

    v_plus  = (1 - beta) * v_old + beta * v      (the policy reinforced toward good samples)
    v_minus = (1 + beta) * v_old - beta * v      (its mirror image through v_old)

    loss = r * |v_plus - target|^2 + (1 - r) * |v_minus - target|^2

``r`` in [0, 1] is each sample's optimality probability: its group-relative advantage, clipped to
``[-adv_clip_max, adv_clip_max]`` and mapped linearly onto [0, 1] (a sample at its group's mean gets
0.5 and no net push). At ``v = v_old`` the gradient with respect to ``v`` is
``2 beta (2 r - 1) (v_old - target)``: a sample with ``r > 1/2`` pulls the velocity toward its own
target (the model learns to produce it), one with ``r < 1/2`` pushes it away, and the strength grows
with the distance from 1/2. Fitting ``v_plus`` to the good samples and ``v_minus`` to the bad ones
moves ``v`` itself along the direction that separates the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.flow_grpo import group_advantages
from miles_diffusion.fsdp import DataParallel, Share, full_norm
from miles_diffusion.model import forward_noise, velocity_target
from miles_diffusion.objectives import Rollout, TrainerConfig
from miles_diffusion.trainer import make_optimizer


@dataclass(frozen=True)
class DiffusionNFTConfig:
    name: ClassVar[str] = "diffusion_nft"
    guidance: ClassVar[str | None] = (
        "DiffusionNFT regresses the conditional velocity on the forward process, its implicit policies "
        "centred on the conditional velocity v_old; images sampled with guidance come from another "
        "policy (the guided velocity), so the loss would no longer be centred on the policy that "
        "sampled (the method is meant to train without CFG)"
    )
    """Why a guidance scale above 1 is refused (``None``: it is supported)."""

    beta: float = 1.0
    """How far the implicit policies sit from ``v_old`` along ``v - v_old`` (must be positive)."""
    adv_clip_max: float = 1.0
    """Advantages are clipped to [-adv_clip_max, adv_clip_max] and mapped linearly onto [0, 1]."""
    timesteps_per_iteration: int = 4
    """Noise levels drawn for every sampled image per iteration, one forward pass each."""
    t_min: float = 0.0
    t_max: float = 1.0
    """Noise levels are drawn uniformly from [t_min, t_max] (``t = 1`` is pure noise)."""
    eps: float = 1e-4

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"diffusion_nft: beta must be positive, got {self.beta}")
        if not 0.0 <= self.t_min <= self.t_max <= 1.0:
            raise ValueError(f"diffusion_nft: need 0 <= t_min <= t_max <= 1, got {self.t_min}, {self.t_max}")
        if self.adv_clip_max <= 0 or self.timesteps_per_iteration < 1:
            raise ValueError("diffusion_nft: adv_clip_max must be positive and timesteps_per_iteration >= 1")


def optimality_probability(
    rewards: torch.Tensor, group_size: int, adv_clip_max: float, eps: float = 1e-4
) -> torch.Tensor:
    """``r = 1/2 + 1/2 * clip(advantage, -m, m) / m`` with group-relative advantages, [B] in [0, 1]."""
    return optimality_from_advantages(group_advantages(rewards, group_size, eps), adv_clip_max)


def optimality_from_advantages(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """``r = 1/2 + 1/2 * clip(advantage, -m, m) / m``, [B] in [0, 1]."""
    return 0.5 + 0.5 * advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max


@dataclass(frozen=True)
class NFTLoss:
    loss: torch.Tensor
    positive: torch.Tensor
    """Mean over the batch of ``r * |v_plus - target|^2`` (detached)."""
    negative: torch.Tensor
    """Mean over the batch of ``(1 - r) * |v_minus - target|^2`` (detached)."""


def nft_loss(
    v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: torch.Tensor, beta: float
) -> NFTLoss:
    """The DiffusionNFT loss at one noise level. ``v`` (trainable), ``v_old`` and ``target``:
    [B, C, H, W]; ``r``: [B] optimality probabilities. Squared errors are per-pixel means."""
    v_old = v_old.detach()
    v_plus = (1.0 - beta) * v_old + beta * v
    v_minus = (1.0 + beta) * v_old - beta * v
    positive = r * ((v_plus - target) ** 2).flatten(1).mean(dim=1)
    negative = (1.0 - r) * ((v_minus - target) ** 2).flatten(1).mean(dim=1)
    loss = (positive + negative).mean()
    return NFTLoss(loss, positive.detach().mean(), negative.detach().mean())


class DiffusionNFTTrainer:
    """Trains on the images of a rollout; the sampling policy's velocities are taken from the model
    as it is when the iteration starts (the sampler used those weights), before any update.

    Data-parallel (:attr:`data_parallel` set by :func:`miles_diffusion.fsdp.data_parallel`), every
    rank gets the whole rollout, draws the noise levels and noise of the whole batch from the same
    generator, trains its share of the rows and returns the statistics of the whole batch."""

    splits_sequences: ClassVar[bool] = False
    """Not tested with sequence parallelism."""

    def __init__(self, model: DiffusionModel, objective: DiffusionNFTConfig, config: TrainerConfig) -> None:
        self.model = model
        self.objective = objective
        self.config = config
        self.optimizer = make_optimizer(model, config)
        self.data_parallel: DataParallel | None = None
        """Set by :func:`miles_diffusion.fsdp.data_parallel`: this rank's share of each batch."""

    def train_on_rollout(self, rollout: Rollout, generator: torch.Generator) -> dict[str, float]:
        cfg = self.objective
        images = rollout.trajectory.latents[:, -1]  # the sampled clean images, model range
        prompts = rollout.trajectory.prompts
        if rollout.advantages is not None:
            r = optimality_from_advantages(rollout.advantages, cfg.adv_clip_max)
        else:
            r = optimality_probability(rollout.rewards, rollout.group_size, cfg.adv_clip_max, cfg.eps)
        self.model.train()
        batch = images.shape[0]
        share = Share.of(self.data_parallel, batch)
        mine, prompts, r_mine = share.take(images), share.take(prompts), share.take(r)
        draws: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():  # every v_old before the first update: the policy that sampled
            for _ in range(cfg.timesteps_per_iteration):
                # the whole batch's draws on every rank (the one-process draws), then this rank's rows
                t = cfg.t_min + (cfg.t_max - cfg.t_min) * torch.rand(batch, generator=generator)
                noise = torch.randn(images.shape, generator=generator)
                t, noise = share.take(t), share.take(noise)
                x_t = forward_noise(mine, noise, t)
                draws.append((x_t, t, velocity_target(mine, noise), self.model(x_t, t, prompts)))
        totals = {"loss": 0.0, "positive_loss": 0.0, "negative_loss": 0.0}
        grad_norms: list[float] = []
        chunk = self.config.steps_per_update
        for start in range(0, len(draws), chunk):
            group = draws[start : start + chunk]
            self.optimizer.zero_grad(set_to_none=True)
            for x_t, t, target, v_old in group:
                out = nft_loss(self.model(x_t, t, prompts), v_old, target, r_mine, cfg.beta)
                (share.weigh(out.loss) / len(group)).backward()
                totals["loss"] += float(out.loss.detach())
                totals["positive_loss"] += float(out.positive)
                totals["negative_loss"] += float(out.negative)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            grad_norms.append(full_norm(norm))
            self.optimizer.step()
        self.model.eval()
        totals = share.batch_means(totals)
        stats = {key: value / len(draws) for key, value in totals.items()}
        stats["grad_norm"] = sum(grad_norms) / len(grad_norms)
        stats["optimality/mean"] = float(r.mean())
        return stats
