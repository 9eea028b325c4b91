"""The pieces between the diffusion engine and the core loop, each alone: seeded sampling, the wire
format, the payload the rollout attaches, the trajectory advantage, and the image rewards as core rewards."""

from __future__ import annotations

import pytest
import torch

from miles.types import Group, Prompt, Sample
from miles_diffusion.advantages import TrajectoryGroupAdvantage
from miles_diffusion.flow_grpo import group_advantages
from miles_diffusion.group_rewards import BrightnessReward, ImageRewardByName
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, load_pretrained, save_pretrained
from miles_diffusion.payload import split, stack
from miles_diffusion.rollout import PromptIdSource, prompt_id, trajectory_seed
from miles_diffusion.sampler import SamplerConfig, sample_seeded
from miles_diffusion.wire import TrajectoryBatch, WireError, metadata, pack, unpack

SAMPLER = SamplerConfig(num_steps=3, noise_level=0.3)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(TinyFlowModelConfig(), seed=0).eval()


def test_each_trajectory_draws_its_noise_from_its_own_seed(model) -> None:
    batch = sample_seeded(model, torch.tensor([0, 1, 2]), [5, 6, 7], SAMPLER)
    alone = sample_seeded(model, torch.tensor([1]), [6], SAMPLER)
    assert torch.equal(batch.latents[1, 0], alone.latents[0, 0])  # the same starting noise
    # Up to the rounding of a differently sized forward pass, the same trajectory.
    torch.testing.assert_close(batch.latents[1], alone.latents[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="one seed per trajectory"):
        sample_seeded(model, torch.tensor([0, 1]), [5], SAMPLER)


def test_prompt_encodings_computed_ahead_give_the_lookup_s_output_bit_for_bit(model) -> None:
    prompts = torch.tensor([3, 0, 3])
    encoded = model.encode_prompts(prompts)
    assert encoded.shape == (3, model.encoding_dim) and encoded.is_floating_point()
    x, t = torch.randn(3, 3, 16, 16), torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        assert torch.equal(model(x, t, encoded), model(x, t, prompts))
    by_ids = sample_seeded(model, prompts, [1, 2, 3], SAMPLER)
    ahead = sample_seeded(model, prompts, [1, 2, 3], SAMPLER, encoded=encoded)
    assert torch.equal(by_ids.latents, ahead.latents) and torch.equal(by_ids.log_probs, ahead.log_probs)
    with pytest.raises(ValueError, match="prompt encodings of shape"):
        model(x, t, encoded[:, :5])
    with pytest.raises(ValueError, match="integer prompt ids"):
        model.encode_prompts(encoded)


def test_the_wire_format_round_trips_exactly_and_refuses_other_bytes(model) -> None:
    trajectory = sample_seeded(model, torch.tensor([3, 0]), [1, 2**62], SAMPLER)
    data = pack(TrajectoryBatch(trajectory, [1, 2**62], SAMPLER, weight_version=7))
    assert metadata(data)["weight_version"] == "7"
    back = unpack(data)
    assert back.sampler == SAMPLER and back.seeds == [1, 2**62] and back.weight_version == 7
    for name in ("latents", "log_probs", "timesteps", "prompts"):
        assert torch.equal(getattr(back.trajectory, name), getattr(trajectory, name))
    for bad in (b"", b"\xff" * 16, data[:40]):
        with pytest.raises(WireError):
            unpack(bad)


def test_payloads_stack_back_into_the_engine_batch_and_a_model_directory_round_trips(model, tmp_path) -> None:
    trajectory = sample_seeded(model, torch.tensor([2, 2]), [3, 4], SAMPLER)
    payloads = split(trajectory, [3, 4], SAMPLER, version=1)
    assert payloads[1].image.shape == (3, 16, 16) and float(payloads[1].image.min()) >= 0
    again = stack(payloads, "test")
    assert torch.equal(again.latents, trajectory.latents) and torch.equal(
        again.log_probs, trajectory.log_probs
    )
    other = split(trajectory, [3, 4], SamplerConfig(3, 0.5), version=1)
    with pytest.raises(ValueError, match="different sampler settings"):
        stack([payloads[0], other[0]], "test")
    loaded = load_pretrained(save_pretrained(model, tmp_path / "m"))
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True)
    )
    (tmp_path / "m" / "config.json").write_text('{"architecture": "LlamaForCausalLM"}')
    with pytest.raises(ValueError, match="MilesTinyFlowUNet"):
        load_pretrained(tmp_path / "m")


def _group(rewards: list[float], index: int = 0) -> Group:
    prompt = Prompt(index=index, prompt=str(index))
    return Group(prompt, [Sample(prompt=prompt, group_index=i, reward=r) for i, r in enumerate(rewards)])


def test_the_trajectory_advantage_is_the_package_s_group_advantage_one_per_sample() -> None:
    groups = [_group([0.5, 0.61, 0.42, 0.58]), _group([0.3, 0.3, 0.3, 0.3], 1)]
    out = TrajectoryGroupAdvantage()(groups)
    assert all(len(row) == 1 for row in out.advantages)
    expected = torch.cat([group_advantages(torch.tensor(g.rewards), 4) for g in groups])
    assert torch.equal(torch.tensor([r[0] for r in out.advantages]), expected)
    assert [r[0] for r in out.advantages[4:]] == [0.0] * 4  # a tied group pushes nothing


def test_image_rewards_score_a_group_from_its_payloads(model) -> None:
    trajectory = sample_seeded(model, torch.tensor([0, 1]), [1, 2], SAMPLER)
    prompt = Prompt(index=0, prompt="0")
    samples = [
        Sample(prompt=prompt, group_index=i, payload=p)
        for i, p in enumerate(split(trajectory, [1, 2], SAMPLER, 0))
    ]
    reward = BrightnessReward()
    assert reward.group_reward
    assert reward(samples) == pytest.approx([float(p.payload.image.mean()) for p in samples])
    assert ImageRewardByName("brightness")(samples) == reward(samples)  # by the package's reward names
    with pytest.raises(TypeError, match="needs the diffusion rollout"):
        reward([Sample(prompt=prompt)])


def test_prompt_ids_and_seeds() -> None:
    source = PromptIdSource("ids:3", shuffle=False, seed=0, prompt_key="prompt", options={})
    assert [p.prompt for p in source.next_prompts(4)] == ["0", "1", "2", "0"]
    assert prompt_id(Prompt(index=5, prompt=" 2 ")) == 2
    with pytest.raises(Exception, match="is not a prompt id"):
        prompt_id(Prompt(index=5, prompt="a red square"))
    seeds = {trajectory_seed(0, step, p, 0, i) for step in range(3) for p in range(4) for i in range(4)}
    assert len(seeds) == 48 and all(0 <= s < 2**63 for s in seeds)
    assert trajectory_seed(0, 1, 2, 0, 3) == trajectory_seed(0, 1, 2, 0, 3) != trajectory_seed(1, 1, 2, 0, 3)
