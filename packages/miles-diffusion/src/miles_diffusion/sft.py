"""Diffusion SFT: fit the rectified-flow velocity on a set of given images (flow matching).

For a batch of images ``x_0`` with prompts, draw ``t ~ U[t_min, t_max]`` and ``eps ~ N(0, I)`` per
image, form ``x_t = (1 - t) x_0 + t eps`` and minimise ``|v(x_t, t, prompt) - (eps - x_0)|^2``
(per-pixel mean, averaged over the batch): the model learns to generate the set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.fsdp import DataParallel, Share, full_norm
from miles_diffusion.model import flow_matching_error
from miles_diffusion.objectives import ImageBatch, TrainerConfig
from miles_diffusion.trainer import make_optimizer


@dataclass(frozen=True)
class SFTConfig:
    name: ClassVar[str] = "sft"
    guidance: ClassVar[str | None] = "sft trains on given images; nothing it trains on is sampled"
    """Why a guidance scale above 1 is refused."""

    t_min: float = 0.0
    t_max: float = 1.0
    """Noise levels are drawn uniformly from [t_min, t_max] (``t = 1`` is pure noise)."""
    updates_per_iteration: int = 1
    """Optimizer steps per iteration, each on its own noise draw of the iteration's batch."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.t_min <= self.t_max <= 1.0:
            raise ValueError(f"sft: need 0 <= t_min <= t_max <= 1, got {self.t_min}, {self.t_max}")
        if self.updates_per_iteration < 1:
            raise ValueError("sft: updates_per_iteration must be >= 1")


class SFTTrainer:
    """Flow matching on given images. Data-parallel (:attr:`data_parallel` set by
    :func:`miles_diffusion.fsdp.data_parallel`), every rank gets the whole batch, draws the noise
    levels and noise of the whole batch from the same generator, trains its share of the rows and
    returns the statistics of the whole batch."""

    splits_sequences: ClassVar[bool] = False
    """Not tested with sequence parallelism."""

    def __init__(self, model: DiffusionModel, objective: SFTConfig, config: TrainerConfig) -> None:
        self.model = model
        self.objective = objective
        self.config = config
        self.optimizer = make_optimizer(model, config)
        self.data_parallel: DataParallel | None = None
        """Set by :func:`miles_diffusion.fsdp.data_parallel`: this rank's share of each batch."""

    def train_on_batch(self, batch: ImageBatch, generator: torch.Generator) -> dict[str, float]:
        cfg = self.objective
        self.model.train()
        size = batch.images.shape[0]
        share = Share.of(self.data_parallel, size)
        images, prompts = share.take(batch.images), share.take(batch.prompts)
        losses: list[float] = []
        grad_norms: list[float] = []
        for _ in range(cfg.updates_per_iteration):
            # the whole batch's draws on every rank (the one-process draws), then this rank's rows
            t = cfg.t_min + (cfg.t_max - cfg.t_min) * torch.rand(size, generator=generator)
            noise = torch.randn(batch.images.shape, generator=generator)
            t, noise = share.take(t), share.take(noise)
            self.optimizer.zero_grad(set_to_none=True)
            loss = flow_matching_error(self.model, images, prompts, noise, t).mean()
            share.weigh(loss).backward()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            self.optimizer.step()
            losses.append(float(loss.detach()))
            grad_norms.append(full_norm(norm))
        self.model.eval()
        stats = share.batch_means({"loss": sum(losses) / len(losses)})
        return {"loss": stats["loss"], "grad_norm": sum(grad_norms) / len(grad_norms)}


@torch.no_grad()
def evaluation_loss(model: DiffusionModel, batch: ImageBatch, seed: int, num_levels: int = 4) -> float:
    """Flow-matching loss on ``batch`` at ``num_levels`` fixed noise levels (midpoints of an even
    grid over [0, 1]) with noise from ``seed``: the same draws every call, so values compare."""
    generator = torch.Generator().manual_seed(seed)
    size = batch.images.shape[0]
    total = 0.0
    for k in range(num_levels):
        t = torch.full((size,), (k + 0.5) / num_levels)
        noise = torch.randn(batch.images.shape, generator=generator)
        total += float(flow_matching_error(model, batch.images, batch.prompts, noise, t).mean())
    return total / num_levels
