from __future__ import annotations

import torch

from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model
from miles_diffusion.sampler import SamplerConfig, sample, step_log_prob
from miles_diffusion.trainer import FlowGRPOTrainer, TrainerConfig, choose_steps


def test_choose_steps_is_a_seeded_subset() -> None:
    a = choose_steps(10, 0.3, torch.Generator().manual_seed(0))
    b = choose_steps(10, 0.3, torch.Generator().manual_seed(0))
    assert a == b and len(a) == 3 and len(set(a)) == 3 and all(0 <= s < 10 for s in a)


def test_a_train_step_raises_the_log_prob_of_positive_advantage_samples() -> None:
    config = TinyFlowModelConfig(num_prompts=2)
    model = build_tiny_model(config, seed=0).eval()
    sampler = SamplerConfig(num_steps=4)
    traj = sample(model, torch.tensor([0, 0, 1, 1]), sampler, torch.Generator().manual_seed(0))
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    trainer = FlowGRPOTrainer(
        model,
        FlowGRPOConfig(clip_range=0.2, kl_coef=0.1),
        TrainerConfig(lr=1e-4, steps_per_update=1),
        sampler.noise_level,
    )
    stats = trainer.train_step(traj, advantages, [1])
    assert stats["kl_ref"] == 0.0  # the first update starts at the reference
    with torch.no_grad():
        after, _, _ = step_log_prob(model, traj, 1, sampler.noise_level)
    delta = after - traj.log_probs[:, 1]
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0
