from __future__ import annotations

import torch

from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model
from miles_diffusion.sampler import SamplerConfig, sample, step_log_prob, timestep_schedule

CONFIG = TinyFlowModelConfig(image_size=16, num_prompts=3)
SAMPLER = SamplerConfig(num_steps=5, noise_level=0.7)


def _trajectory(seed: int = 7):
    model = build_tiny_model(CONFIG, seed=0).eval()
    prompts = torch.tensor([0, 0, 1, 2])
    return model, sample(model, prompts, SAMPLER, torch.Generator().manual_seed(seed))


def test_trajectory_shapes_and_schedule() -> None:
    _, traj = _trajectory()
    assert traj.latents.shape == (4, 6, 3, 16, 16)
    assert traj.log_probs.shape == (4, 5)
    assert torch.equal(traj.timesteps, timestep_schedule(5))
    assert traj.timesteps[0] == 1.0 and traj.timesteps[-1] == 0.0
    assert torch.isfinite(traj.log_probs).all()
    assert traj.images.min() >= 0.0 and traj.images.max() <= 1.0


def test_trainer_rescoring_matches_sampler_log_probs() -> None:
    model, traj = _trajectory()
    model.train()  # the trainer re-scores in train mode
    for step in range(traj.num_steps):
        recomputed, _, _ = step_log_prob(model, traj, step, SAMPLER.noise_level)
        assert torch.allclose(recomputed, traj.log_probs[:, step], rtol=0.0, atol=1e-6)
        assert torch.equal(recomputed.detach(), traj.log_probs[:, step])


def test_log_prob_is_the_gaussian_density_of_the_step() -> None:
    model, traj = _trajectory()
    step = 2
    _, mean, std = step_log_prob(model, traj, step, SAMPLER.noise_level)
    reference = torch.distributions.Normal(mean.detach(), std).log_prob(traj.latents[:, step + 1])
    assert torch.allclose(reference.flatten(1).mean(1), traj.log_probs[:, step], atol=1e-5)


def test_a_different_model_scores_the_trajectory_differently() -> None:
    _, traj = _trajectory()
    other = build_tiny_model(CONFIG, seed=1)
    rescored, _, _ = step_log_prob(other, traj, 0, SAMPLER.noise_level)
    assert not torch.allclose(rescored, traj.log_probs[:, 0], atol=1e-4)


def test_sampling_is_deterministic_given_a_seed() -> None:
    _, a = _trajectory(seed=3)
    _, b = _trajectory(seed=3)
    _, c = _trajectory(seed=4)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.latents, c.latents)


def test_model_is_built_reproducibly_without_touching_the_global_rng() -> None:
    torch.manual_seed(11)
    expected = torch.rand(1)
    torch.manual_seed(11)
    a = build_tiny_model(CONFIG, seed=5)
    after = torch.rand(1)
    b = build_tiny_model(CONFIG, seed=5)
    assert torch.equal(expected, after)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
