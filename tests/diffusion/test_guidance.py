"""Classifier-free guidance on the scaled-down SD3 and Wan proxies: the guided velocity is
``v_uncond + w (v_cond - v_uncond)`` with the empty prompt's encoding as the unconditional branch,
equal to what diffusers' StableDiffusion3Pipeline steps with at ``guidance_scale=w``; guided
sampling differs from unguided, and the trainer's re-scoring (Flow-GRPO's) gives the engine's
log-probabilities bit for bit at w = 4.5; what cannot run correctly is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.families import check_family_guidance, family_for, load_model
from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.guidance import GuidanceError, guided_velocity
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, save_pretrained
from miles_diffusion.nft import DiffusionNFTConfig
from miles_diffusion.objectives import ObjectiveContext, TrainerConfig, build_objective
from miles_diffusion.recipe import recipe_from_dict
from miles_diffusion.sampler import SamplerConfig, sample, sample_seeded, step_distribution, step_log_prob
from miles_diffusion.sd3 import SD3FlowModel
from miles_diffusion.sft import SFTConfig
from miles_diffusion.train import resolve_model_dir
from miles_diffusion.trainer import FlowGRPOTrainer
from miles_diffusion.wan import WanFlowModel

from ._step_checks import first_step_recorder

PROMPTS = ("a photo of a red apple", "a lighthouse at dusk", "Ünïcode, punctuation & CAPS!")
W = 4.5
GUIDED = SamplerConfig(num_steps=4, noise_level=0.7, guidance_scale=W)


@pytest.fixture(scope="module")
def sd3_dir() -> Path:
    return resolve_model_dir("builtin:tiny-sd3")


@pytest.fixture(scope="module")
def sd3(sd3_dir: Path) -> SD3FlowModel:
    loaded = load_model(sd3_dir, prompts=PROMPTS)
    assert isinstance(loaded, SD3FlowModel)
    return loaded


@pytest.fixture(scope="module")
def wan() -> WanFlowModel:
    loaded = load_model(resolve_model_dir("builtin:tiny-wan"), prompts=PROMPTS)
    assert isinstance(loaded, WanFlowModel)
    return loaded


def _noise(model: DiffusionModel, batch: int, seed: int = 3) -> torch.Tensor:
    return torch.randn((batch, *model.latent_shape), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["sd3", "wan"])
@torch.no_grad()
def test_the_guided_velocity_is_the_cfg_formula(family: str, request: pytest.FixtureRequest) -> None:
    """One step by hand: the conditional and the empty-prompt velocities, each its own forward pass,
    combined as v_u + w (v_c - v_u), equal the guided velocity (one forward of 2B) within rounding;
    the step's mean moves with it, and w = 1 is the unguided velocity bit for bit."""
    model: Any = request.getfixturevalue(family)
    prompts = torch.tensor([0, 2, 1])
    x = _noise(model, 3)
    t = torch.full((3,), 0.75)
    v_cond = model(x, t, prompts)
    v_uncond = model(x, t, model.encode_texts(["", "", ""]))
    by_hand = v_uncond + W * (v_cond - v_uncond)
    guided = guided_velocity(model, x, t, prompts, W)
    torch.testing.assert_close(guided, by_hand, rtol=0, atol=1e-5)
    assert (guided - v_cond).abs().max() > 1e-3  # guidance changes the velocity
    assert torch.equal(guided_velocity(model, x, t, prompts, 1.0), v_cond)
    mean_w, std_w = step_distribution(model, x, 0.75, 0.5, prompts, 0.7, W)
    mean_1, std_1 = step_distribution(model, x, 0.75, 0.5, prompts, 0.7)
    assert torch.equal(std_w, std_1) and (mean_w - mean_1).abs().max() > 1e-4
    dt, sigma = 0.25, 0.7 * (0.75 / 0.25) ** 0.5
    expected = x - dt * (by_hand + sigma**2 / (2 * 0.75) * (x + 0.25 * by_hand))
    torch.testing.assert_close(mean_w, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_guided_engine_log_probs_equal_the_trainers_rescoring(
    family: str, request: pytest.FixtureRequest
) -> None:
    """At w = 4.5 the engine's form (prompts encoded once, per-trajectory seeds) and the driver's form
    give log-probabilities the trainer re-scores with the same scale bit for bit at every step (gap
    0); the same seeds unguided draw other latents, and re-scoring without the scale does not agree."""
    model: Any = request.getfixturevalue(family)
    prompts = torch.tensor([2, 0, 2, 1])
    distinct, inverse = torch.unique(prompts, return_inverse=True)
    encoded = model.encode_prompts(distinct)[inverse]
    seeds = [11, 12, 13, 14]
    engine = sample_seeded(model, prompts, seeds, GUIDED, encoded=encoded)
    driver = sample(model, prompts, GUIDED, torch.Generator().manual_seed(0))
    for trajectory in (engine, driver):
        for step in range(GUIDED.num_steps):
            with torch.no_grad():
                rescored, _, _ = step_log_prob(model, trajectory, step, GUIDED.noise_level, W)
            assert torch.equal(rescored, trajectory.log_probs[:, step]), step
    unguided = sample_seeded(model, prompts, seeds, SamplerConfig(4, 0.7), encoded=encoded)
    assert torch.equal(unguided.latents[:, 0], engine.latents[:, 0])  # same starting noise
    assert (unguided.latents[:, -1] - engine.latents[:, -1]).abs().max() > 1e-3
    with torch.no_grad():
        wrong, _, _ = step_log_prob(model, engine, 1, GUIDED.noise_level)
    assert not torch.equal(wrong, engine.log_probs[:, 1])


def test_flow_grpo_rescores_guided_steps_with_the_samplers_scale(sd3: SD3FlowModel) -> None:
    """Flow-GRPO built from the sampler settings (as the driver and the backend build it) re-scores
    with w: before its one optimizer step every ratio is exactly 1 (no clipping, approx KL 0), and the
    step moves the transformer."""
    import copy

    model = copy.deepcopy(sd3)
    prompts = torch.tensor([0, 0, 1, 1])
    trajectory = sample_seeded(model, prompts, [1, 2, 3, 4], GUIDED)
    trainer = build_objective(
        FlowGRPOConfig(clip_range=0.05),
        ObjectiveContext(model, TrainerConfig(lr=1e-2, steps_per_update=4), GUIDED),
    )
    assert isinstance(trainer, FlowGRPOTrainer) and trainer.guidance_scale == W
    before = {k: v.clone() for k, v in model.transformer.state_dict().items()}
    stats = trainer.train_step(trajectory, torch.tensor([1.0, -1.0, 0.5, -0.5]), [0, 1, 2, 3])
    assert stats["approx_kl_old"] == 0.0 and stats["clip_fraction"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in model.transformer.state_dict().items())


@pytest.mark.parametrize("family", ["sd3", "wan"])
@torch.no_grad()
def test_the_guided_step_is_diffusers_step(family: str, request: pytest.FixtureRequest) -> None:
    """diffusers' own pipeline (StableDiffusion3Pipeline, WanPipeline) at guidance_scale=w, with its
    default negative prompt (the empty one), from the same starting latents: its first Euler step
    x1 = x0 + (s1 - s0) v equals ours with our guided velocity (SD3 bit for bit on this machine; Wan's
    pipeline runs the two branches as two forward passes, ours as one of 2B: within rounding), and
    its negative-prompt encoding is our unconditional one bit for bit."""
    from diffusers import StableDiffusion3Pipeline, WanPipeline

    model: Any = request.getfixturevalue(family)
    directory = str(resolve_model_dir(f"builtin:tiny-{family}"))
    pipe: Any
    if family == "sd3":
        pipe = StableDiffusion3Pipeline.from_pretrained(
            directory, text_encoder_3=None, tokenizer_3=None, dtype=torch.float32
        )
        size: dict[str, int] = {"height": 32, "width": 32}
        negative = pipe.encode_prompt(PROMPTS[1], None, None, do_classifier_free_guidance=True)[1]
    else:
        pipe = WanPipeline.from_pretrained(directory, dtype=torch.float32)
        size = {"height": 16, "width": 16, "num_frames": 5}
        negative = pipe.encode_prompt(PROMPTS[1], do_classifier_free_guidance=True, max_sequence_length=512)[
            1
        ]
    assert torch.equal(negative, model.encode_texts([""]).sequence)
    x0 = _noise(model, 1, seed=7)
    seen: dict[str, torch.Tensor] = {}

    pipe(
        prompt=PROMPTS[1],
        num_inference_steps=4,
        guidance_scale=W,
        latents=x0.clone(),
        output_type="latent",
        callback_on_step_end=first_step_recorder(seen),
        callback_on_step_end_tensor_inputs=["latents"],
        **size,
    )
    times = model.timestep_schedule(4)
    s0, s1 = float(times[0]), float(times[1])
    v = guided_velocity(model, x0, torch.full((1,), s0), torch.tensor([1]), W)
    torch.testing.assert_close(seen["latents"], x0 + (s1 - s0) * v, rtol=0, atol=1e-5)
    unguided = x0 + (s1 - s0) * model(x0, torch.full((1,), s0), torch.tensor([1]))
    assert (seen["latents"] - unguided).abs().max() > 1e-3


def test_refusals(sd3: SD3FlowModel, sd3_dir: Path, tmp_path: Path) -> None:
    """Each refused with one GuidanceError (a ValueError) naming what to do, before any forward pass."""
    for bad in (0.5, float("nan"), float("inf"), True):
        with pytest.raises(GuidanceError, match=r"sampler\.guidance_scale must be"):
            SamplerConfig(guidance_scale=bad)
    tiny = build_tiny_model(TinyFlowModelConfig(), 0)
    calls: list[int] = []
    tiny.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(GuidanceError, match="FlowModel has no unconditional branch"):
        sample(tiny, torch.tensor([0, 1]), GUIDED, torch.Generator().manual_seed(0))
    with pytest.raises(GuidanceError, match="no unconditional branch"):
        FlowGRPOTrainer(tiny, FlowGRPOConfig(), TrainerConfig(), 0.7, W)
    assert calls == []
    # the family is judged from its directory, before loading
    tiny_dir = save_pretrained(tiny, tmp_path / "tiny")
    with pytest.raises(GuidanceError, match="the tiny-flow-unet family has no unconditional branch"):
        check_family_guidance(family_for(tiny_dir), W)
    check_family_guidance(family_for(sd3_dir), W)
    with pytest.raises(GuidanceError, match=r"tiny UNet .* no unconditional branch"):
        recipe_from_dict({"name": "x", "evidence_level": "not verified", "sampler": {"guidance_scale": 2}})
    base = {"name": "x", "evidence_level": "not verified", "model": "builtin:tiny-sd3", "prompts": ["a"]}
    assert recipe_from_dict({**base, "sampler": {"guidance_scale": W}}).sampler.guidance_scale == W
    with pytest.raises(GuidanceError, match="objective 'diffusion_nft': DiffusionNFT regresses"):
        recipe_from_dict({**base, "sampler": {"guidance_scale": W}, "objective": {"name": "diffusion_nft"}})
    with pytest.raises(GuidanceError, match="objective 'sft': sft trains on given images"):
        build_objective(SFTConfig(), ObjectiveContext(tiny, TrainerConfig(), GUIDED))
    with pytest.raises(GuidanceError, match="objective 'diffusion_nft'"):
        build_objective(DiffusionNFTConfig(), ObjectiveContext(sd3, TrainerConfig(), GUIDED))
    with pytest.raises(GuidanceError, match=r"must be >= 1\.0"):
        recipe_from_dict({**base, "sampler": {"guidance_scale": 0.0}})
