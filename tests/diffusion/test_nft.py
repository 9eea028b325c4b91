from __future__ import annotations

import pytest
import torch

from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, flow_matching_error
from miles_diffusion.nft import DiffusionNFTConfig, DiffusionNFTTrainer, nft_loss, optimality_probability
from miles_diffusion.objectives import Rollout, TrainerConfig
from miles_diffusion.sampler import SamplerConfig, sample

from ._standards import assert_matches_standard, run_recipe, write_standard

PROXY_ITERATIONS = 6
"""The proxy of ``tiny_diffusion_nft`` its committed standard records: the recipe, 6 iterations."""
PROXY_STANDARD = "tiny_diffusion_nft_proxy"


@pytest.fixture(scope="module")
def proxy_run() -> list[dict[str, float]]:
    return run_recipe("tiny_diffusion_nft", PROXY_ITERATIONS)


def test_optimality_probability_maps_clipped_group_advantages_onto_0_1() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0])
    r = optimality_probability(rewards, group_size=4, adv_clip_max=1.0)
    assert r.min() >= 0.0 and r.max() <= 1.0
    assert r[0] == 0.0 and r[3] == 1.0  # +-1.34 standard deviations, clipped
    assert r[0] < r[1] < 0.5 < r[2] < r[3]
    assert torch.equal(r[4:], torch.full((4,), 0.5))  # a tied group pushes nowhere
    wide = optimality_probability(rewards, group_size=4, adv_clip_max=2.0)
    assert 0.0 < wide[0] < wide[1] and wide[3] < 1.0


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_at_the_old_policy_the_gradient_pulls_toward_good_targets_and_pushes_from_bad(beta: float) -> None:
    gen = torch.Generator().manual_seed(0)
    v_old = torch.randn(3, 2, 4, 4, generator=gen)
    target = torch.randn(3, 2, 4, 4, generator=gen)
    r = torch.tensor([1.0, 0.0, 0.5])
    v = v_old.clone().requires_grad_(True)
    out = nft_loss(v, v_old, target, r, beta)
    out.loss.backward()
    assert v.grad is not None
    pixels = v_old[0].numel()
    expected = 2.0 * beta * (2.0 * r - 1.0)[:, None, None, None] * (v_old - target) / (3 * pixels)
    assert torch.allclose(v.grad, expected, atol=1e-7)
    step = -v.grad  # the gradient-descent direction
    toward = (target - v_old).flatten(1)
    assert (step.flatten(1)[0] @ toward[0]) > 0 > (step.flatten(1)[1] @ toward[1])
    assert v.grad[2].abs().max() < 1e-8  # r = 1/2: no net push (up to rounding)
    assert torch.allclose(out.loss, ((v_old - target) ** 2).mean())  # both policies equal v_old here


def test_a_train_step_fits_positive_samples_better_and_negative_ones_worse() -> None:
    """The measurable effect of one DiffusionNFT update: the flow-matching error of the model on the
    high-reward samples (fixed noise levels and noise) falls, on the low-reward ones it rises."""
    config = TinyFlowModelConfig(num_prompts=2)
    model = build_tiny_model(config, seed=0).eval()
    traj = sample(
        model,
        torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        SamplerConfig(num_steps=4),
        torch.Generator().manual_seed(0),
    )
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    positive = rewards == 1.0
    images = traj.latents[:, -1]
    probe = torch.Generator().manual_seed(5)
    levels = [torch.full((8,), t) for t in (0.2, 0.5, 0.8)]
    noises = [torch.randn(images.shape, generator=probe) for _ in levels]

    def errors() -> torch.Tensor:
        with torch.no_grad():
            pairs = zip(noises, levels, strict=True)
            return torch.stack(
                [flow_matching_error(model, images, traj.prompts, n, t) for n, t in pairs]
            ).sum(0)

    before = errors()
    trainer = DiffusionNFTTrainer(
        model, DiffusionNFTConfig(timesteps_per_iteration=4), TrainerConfig(lr=1e-4, steps_per_update=4)
    )
    stats = trainer.train_on_rollout(Rollout(traj, rewards, group_size=4), torch.Generator().manual_seed(1))
    assert stats["optimality/mean"] == 0.5
    delta = errors() - before
    assert (delta[positive] < 0).all(), delta
    assert (delta[~positive] > 0).all(), delta


@pytest.mark.slow
def test_the_nft_recipe_raises_the_reward(proxy_run: list[dict[str, float]]) -> None:
    history = proxy_run
    before, after = history[0]["eval/reward_before"], history[-1]["eval/reward_after"]
    assert after > before + 0.03, (before, after)
    assert history[-1]["reward/mean"] > history[0]["reward/mean"]
    assert all(m["train/grad_norm"] > 0 for m in history)


@pytest.mark.slow
def test_the_nft_proxy_matches_its_committed_standard(proxy_run: list[dict[str, float]]) -> None:
    assert_matches_standard(PROXY_STANDARD, proxy_run)


if __name__ == "__main__":  # regenerate the standard: uv run python -m tests.diffusion.test_nft
    torch.set_num_threads(1)
    print(f"wrote {write_standard(PROXY_STANDARD, run_recipe('tiny_diffusion_nft', PROXY_ITERATIONS))}")
