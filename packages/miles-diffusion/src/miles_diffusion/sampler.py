"""SDE sampling for rectified flow with a log-probability at every denoising step (Flow-GRPO).

The deterministic flow ODE ``dx = v dt`` (run from ``t = 1`` to ``t = 0``) has the same marginals as
the reverse-time SDE ``dx = [v + sigma_t^2 / (2 t) * (x + (1 - t) v)] dt + sigma_t dW``, because
``-(x + (1 - t) v) / t`` is the score of the noisy marginal when ``x_t = (1 - t) x_0 + t eps``. An
Euler-Maruyama step of that SDE from ``t`` to ``t_next = t - dt`` is Gaussian,

    x_next ~ N(mean, std^2),  mean = x - dt * [v + sigma_t^2 / (2 t) * (x + (1 - t) v)],
                              std  = sigma_t * sqrt(dt),

so each step has an exact log-probability. ``sigma_t = noise_level * sqrt(t / (1 - t))``, with
``1 - t`` floored at one step width so the first step (``t = 1``) stays finite.

One function, :func:`step_distribution`, gives the Gaussian for both the sampler and the trainer, so
the two compute a step's log-probability through the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_diffusion.denoiser import linear_schedule
from miles_diffusion.guidance import NO_GUIDANCE, check_model, check_scale, guided_velocity

if TYPE_CHECKING:  # only for annotations (the decode workers import this module without diffusers)
    from miles_diffusion.denoiser import Conditioning, DiffusionModel

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SamplerConfig:
    num_steps: int = 10
    noise_level: float = 0.7
    guidance_scale: float = NO_GUIDANCE
    """Classifier-free guidance scale ``w`` (>= 1; 1 is none): each step's velocity is
    ``v_uncond + w (v_cond - v_uncond)``, two branches in one forward pass (:mod:`miles_diffusion.guidance`)."""

    def __post_init__(self) -> None:
        check_scale(self.guidance_scale, "sampler.guidance_scale")


@dataclass(frozen=True)
class Trajectory:
    """One batch of denoising trajectories, whole.

    ``latents``: [B, S + 1, C, H, W] (index 0 is the starting noise, index S the image);
    ``timesteps``: [S + 1] from 1 to 0; ``log_probs``: [B, S], the log-probability of step ``i``
    (``latents[:, i] -> latents[:, i + 1]``) under the sampling policy; ``prompts``: [B].
    """

    latents: torch.Tensor
    timesteps: torch.Tensor
    log_probs: torch.Tensor
    prompts: torch.Tensor

    @property
    def images(self) -> torch.Tensor:
        """Final images mapped from the model's [-1, 1] range to [0, 1], [B, C, H, W]."""
        return ((self.latents[:, -1] + 1.0) / 2.0).clamp(0.0, 1.0)

    @property
    def num_steps(self) -> int:
        return int(self.log_probs.shape[1])


def timestep_schedule(num_steps: int) -> torch.Tensor:
    """``num_steps + 1`` evenly spaced times from 1 (noise) to 0 (image) (the tiny model's schedule;
    a family may shift it: ``DiffusionModel.timestep_schedule``)."""
    return linear_schedule(num_steps)


def step_distribution(
    model: DiffusionModel,
    x_t: torch.Tensor,
    t: float,
    t_next: float,
    prompts: Conditioning,
    noise_level: float,
    guidance_scale: float = NO_GUIDANCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [B, C, H, W] and scalar std of the Gaussian for the step ``t -> t_next``.

    ``prompts``: the prompt ids [B], or their encodings (:meth:`DiffusionModel.encode_prompts`);
    ``guidance_scale``: the step's velocity is the guided one (:func:`guided_velocity`)."""
    dt = t - t_next
    batch = x_t.shape[0]
    v = guided_velocity(
        model, x_t, torch.full((batch,), t, dtype=x_t.dtype, device=x_t.device), prompts, guidance_scale
    )
    sigma = noise_level * math.sqrt(t / max(1.0 - t, dt))
    drift = v + (sigma**2 / (2.0 * t)) * (x_t + (1.0 - t) * v)
    mean = x_t - dt * drift
    std = torch.tensor(sigma * math.sqrt(dt), dtype=x_t.dtype, device=x_t.device)
    return mean, std


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample log-density averaged over pixels (so its scale does not grow with image size), [B]."""
    per_pixel = -((x - mean) ** 2) / (2.0 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return per_pixel.flatten(1).mean(dim=1)


def step_log_prob(
    model: DiffusionModel,
    trajectory: Trajectory,
    step: int,
    noise_level: float,
    guidance_scale: float = NO_GUIDANCE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-score recorded step ``step`` with ``model``: (log_prob [B], mean, std). Differentiable.
    ``guidance_scale`` must be the one the trajectory was sampled with."""
    t = float(trajectory.timesteps[step])
    t_next = float(trajectory.timesteps[step + 1])
    mean, std = step_distribution(
        model, trajectory.latents[:, step], t, t_next, trajectory.prompts, noise_level, guidance_scale
    )
    return gaussian_log_prob(trajectory.latents[:, step + 1], mean, std), mean, std


@torch.no_grad()
def sample(
    model: DiffusionModel, prompts: torch.Tensor, config: SamplerConfig, generator: torch.Generator
) -> Trajectory:
    """Sample one trajectory per prompt id in ``prompts``; all noise comes from ``generator``."""
    return _sample(model, prompts, config, lambda shape: torch.randn(shape, generator=generator))


@torch.no_grad()
def sample_seeded(
    model: DiffusionModel,
    prompts: torch.Tensor,
    seeds: list[int],
    config: SamplerConfig,
    *,
    encoded: Conditioning | None = None,
) -> Trajectory:
    """Sample one trajectory per prompt id, the noise of trajectory ``i`` from its own ``seeds[i]``.

    So a trajectory's noise depends on its seed alone, not on what else is in the batch (the
    engine's form: a request is sampled in microgroups). The batch's size still sets the rounding
    of the model's forward pass (a few ulp). ``encoded``: the prompts' encodings, computed once
    per request by :meth:`DiffusionModel.encode_prompts` and reused for every microgroup; without it
    the model encodes ``prompts`` at every step."""
    if len(seeds) != prompts.shape[0]:
        raise ValueError(f"{len(seeds)} seeds for {prompts.shape[0]} prompts; give one seed per trajectory")
    if encoded is not None and len(encoded) != prompts.shape[0]:
        raise ValueError(f"{len(encoded)} prompt encodings for {prompts.shape[0]} prompts")
    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.stack([torch.randn(shape[1:], generator=g) for g in generators])

    return _sample(model, prompts, config, draw, encoded)


def _sample(
    model: DiffusionModel,
    prompts: torch.Tensor,
    config: SamplerConfig,
    draw: Callable[[tuple[int, ...]], torch.Tensor],
    encoded: Conditioning | None = None,
) -> Trajectory:
    check_model(model, config.guidance_scale)  # before any forward pass
    condition = prompts if encoded is None else encoded
    shape = (prompts.shape[0], *model.latent_shape)
    times = model.timestep_schedule(config.num_steps)
    # Noise is drawn on the CPU, from CPU generators, and moved: a seed gives the same noise on any
    # device (CUDA generators draw other numbers), so a GPU engine's trajectories replay on a CPU.
    device = next(model.parameters()).device
    x = draw(shape).to(device)
    start = float(times[0])
    if start != 1.0:
        # pure noise at a first time below 1 (Cosmos: sigma_max is finite) is x = t0 * noise, the
        # image term (1 - t0) x_0 dropped; skipped at t0 = 1 so other families' draws stay bit-exact
        x = x * start
    latents = [x]
    log_probs = []
    for i in range(config.num_steps):
        t, t_next = float(times[i]), float(times[i + 1])
        mean, std = step_distribution(
            model, x, t, t_next, condition, config.noise_level, config.guidance_scale
        )
        x = mean + std * draw(shape).to(device)
        log_probs.append(gaussian_log_prob(x, mean, std))
        latents.append(x)
    return Trajectory(
        latents=torch.stack(latents, dim=1),
        timesteps=times,
        log_probs=torch.stack(log_probs, dim=1),
        prompts=prompts,
    )
