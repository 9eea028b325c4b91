"""Flow-GRPO trainer: re-scores a chosen subset of recorded denoising steps and updates the model.

Plain torch in one process (an AdamW optimizer), or data-parallel over FSDP2 ranks
(:func:`miles_diffusion.fsdp.data_parallel`): each rank re-scores its share of the trajectories on the
same seeded subset of steps, its loss divided by the global batch so that the gradients FSDP2 sums
are the one-process gradient.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import torch

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.flow_grpo import FlowGRPOConfig, flow_grpo_step_loss, group_advantages
from miles_diffusion.fsdp import Share, full_norm
from miles_diffusion.guidance import NO_GUIDANCE, check_model
from miles_diffusion.objectives import Rollout, TrainerConfig
from miles_diffusion.sampler import Trajectory, step_distribution, step_log_prob

if TYPE_CHECKING:
    from miles_diffusion.fsdp import DataParallel

__all__ = ["FlowGRPOTrainer", "TrainerConfig", "choose_steps", "make_optimizer"]


def make_optimizer(model: DiffusionModel, config: TrainerConfig) -> torch.optim.Optimizer:
    """The AdamW optimizer every objective trains with, over the parameters that train (all of them,
    or only a LoRA adapter's: a frozen base keeps no optimizer state)."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=config.betas,
        eps=config.eps,
    )


def choose_steps(num_steps: int, fraction: float, generator: torch.Generator) -> list[int]:
    """A random subset of ``ceil(fraction * num_steps)`` step indices, in a seeded order."""
    count = max(1, math.ceil(fraction * num_steps))
    return [int(i) for i in torch.randperm(num_steps, generator=generator)[:count]]


class FlowGRPOTrainer:
    splits_sequences: ClassVar[bool] = True
    """Tested with sequence parallelism (:func:`miles_diffusion.fsdp.data_parallel`)."""

    def __init__(
        self,
        model: DiffusionModel,
        objective: FlowGRPOConfig,
        config: TrainerConfig,
        noise_level: float,
        guidance_scale: float = NO_GUIDANCE,
    ) -> None:
        check_model(model, guidance_scale)
        self.model = model
        self.objective = objective
        self.config = config
        self.noise_level = noise_level
        self.guidance_scale = guidance_scale
        """The sampler's classifier-free guidance scale: re-scoring (and the KL reference) uses the
        same guided velocity, so a step's log-probability is the one the sampler recorded."""
        self.optimizer = make_optimizer(model, config)
        self.reference: DiffusionModel | None = None
        if objective.kl_coef > 0:
            self.reference = copy.deepcopy(model).requires_grad_(False)
        self.data_parallel: DataParallel | None = None
        """Set by :func:`miles_diffusion.fsdp.data_parallel`: this rank's share of each batch."""

    def _kl_to_reference(
        self, trajectory: Trajectory, step: int, mean: torch.Tensor, std: torch.Tensor
    ) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            ref_mean, _ = step_distribution(
                self.reference,
                trajectory.latents[:, step],
                float(trajectory.timesteps[step]),
                float(trajectory.timesteps[step + 1]),
                trajectory.prompts,
                self.noise_level,
                self.guidance_scale,
            )
        return ((mean - ref_mean) ** 2).flatten(1).mean(dim=1) / (2.0 * std**2)

    def train_on_rollout(self, rollout: Rollout, generator: torch.Generator) -> dict[str, float]:
        """Group-relative advantages of the rollout's rewards (or the rollout's own advantages), then
        :meth:`train_step` on a seeded random subset of its denoising steps (``train_step_fraction``)."""
        advantages = rollout.advantages
        if advantages is None:
            advantages = group_advantages(rollout.rewards, rollout.group_size, self.objective.eps)
        trajectory = rollout.trajectory
        steps = choose_steps(trajectory.num_steps, self.config.train_step_fraction, generator)
        return self.train_step(trajectory, advantages, steps)

    def train_step(
        self, trajectory: Trajectory, advantages: torch.Tensor, steps: list[int]
    ) -> dict[str, float]:
        """One Flow-GRPO iteration over ``steps`` of ``trajectory``; returns mean loss statistics.

        Data-parallel (:attr:`data_parallel` set), every rank gets the whole batch and the same
        ``steps``, trains its share of the rows and returns the statistics of the whole batch."""
        share = Share.of(self.data_parallel, trajectory.latents.shape[0])
        trajectory = replace(
            trajectory,
            latents=share.take(trajectory.latents),
            log_probs=share.take(trajectory.log_probs),
            prompts=share.take(trajectory.prompts),
        )
        advantages = share.take(advantages)
        self.model.train()
        totals = {"loss": 0.0, "clip_fraction": 0.0, "approx_kl_old": 0.0, "kl_ref": 0.0}
        grad_norms: list[float] = []
        chunk = self.config.steps_per_update
        for start in range(0, len(steps), chunk):
            group = steps[start : start + chunk]
            self.optimizer.zero_grad(set_to_none=True)
            for step in group:
                new_lp, mean, std = step_log_prob(
                    self.model, trajectory, step, self.noise_level, self.guidance_scale
                )
                out = flow_grpo_step_loss(
                    new_lp,
                    trajectory.log_probs[:, step],
                    advantages,
                    self.objective,
                    self._kl_to_reference(trajectory, step, mean, std),
                )
                # Each loss term is a mean over the rows: weighted by the rank's share of the batch,
                # the ranks' losses sum to the whole batch's (FSDP2 sums the gradients).
                (share.weigh(out.loss) / len(group)).backward()
                totals["loss"] += float(out.loss.detach())
                totals["clip_fraction"] += float(out.clip_fraction)
                totals["approx_kl_old"] += float(out.approx_kl_old)
                totals["kl_ref"] += float(out.kl_ref)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            grad_norms.append(full_norm(norm))
            self.optimizer.step()
        self.model.eval()
        totals = share.batch_means(totals)
        stats = {key: value / len(steps) for key, value in totals.items()}
        stats["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return stats
