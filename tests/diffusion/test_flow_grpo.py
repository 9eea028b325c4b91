from __future__ import annotations

import pytest
import torch

from miles_diffusion.flow_grpo import FlowGRPOConfig, flow_grpo_step_loss, group_advantages


def test_group_advantages_standardise_each_group() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
    adv = group_advantages(rewards, group_size=3)
    assert torch.allclose(adv[:3].mean(), torch.tensor(0.0), atol=1e-6)
    assert adv[0] < 0 < adv[2]
    assert torch.equal(adv[3:], torch.zeros(3))
    with pytest.raises(ValueError):
        group_advantages(rewards, group_size=4)


def test_loss_pushes_log_prob_up_for_positive_advantage() -> None:
    new = torch.zeros(2, requires_grad=True)
    out = flow_grpo_step_loss(new, torch.zeros(2), torch.tensor([1.0, -1.0]), FlowGRPOConfig())
    out.loss.backward()
    assert new.grad is not None
    assert new.grad[0] < 0 < new.grad[1]  # gradient descent raises sample 0, lowers sample 1


def test_clipping_stops_the_gradient_outside_the_trust_region() -> None:
    config = FlowGRPOConfig(clip_range=0.01)
    new = torch.tensor([0.5, -0.5], requires_grad=True)  # ratios far above / below the range
    out = flow_grpo_step_loss(new, torch.zeros(2), torch.tensor([1.0, -1.0]), config)
    out.loss.backward()
    assert new.grad is not None
    assert torch.equal(new.grad, torch.zeros(2))
    assert out.clip_fraction == 1.0


def test_kl_term_is_weighted_in() -> None:
    new, old, adv = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    kl = torch.tensor([0.2, 0.4])
    out = flow_grpo_step_loss(new, old, adv, FlowGRPOConfig(kl_coef=0.5), kl_ref=kl)
    assert torch.allclose(out.loss, torch.tensor(0.15))
