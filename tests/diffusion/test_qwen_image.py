"""The Qwen-Image family on its scaled-down proxy (builtin:tiny-qwen-image): the directory picks its
family, diffusers' own QwenImagePipeline loads the proxy, the conditioning is Qwen-Image's (its chat
template, the real Qwen2 tokenizer, the dropped prefix; bit for bit against the pipeline's
encode_prompt), the schedule and the deterministic ODE path are the pipeline's, the sampler's
log-probabilities are the trainer's re-scoring bit for bit, only the transformer trains, and the
driver runs both recipes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles_diffusion.families import check_family_guidance, family_for, load_model
from miles_diffusion.guidance import GuidanceError, guided_velocity
from miles_diffusion.qwen_image import (
    PROMPT_TEMPLATE,
    TEMPLATE_PREFIX_TOKENS,
    QwenImageEncodings,
    QwenImageFlowModel,
    pack_latents,
    unpack_latents,
)
from miles_diffusion.sampler import SamplerConfig, sample_seeded, step_log_prob

from ._family_checks import (
    check_a_prompts_velocity_ignores_its_batch,
    check_log_probs_equal_the_trainers_rescoring,
    check_one_driver_iteration_of_each_recipe,
    check_only_the_transformer_trains,
    index_copy,
    proxy_fixtures,
)
from ._step_checks import first_step_recorder

PROMPTS = ("a red cube on a table", "two cats", "Ünïcode, punctuation & CAPS! 日本語")


proxy_dir, model = proxy_fixtures("builtin:tiny-qwen-image", PROMPTS, QwenImageFlowModel)


@pytest.fixture(scope="module")
def pipe(proxy_dir: Path) -> Any:
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(str(proxy_dir), dtype=torch.float32)


def test_the_directory_picks_its_family(proxy_dir: Path, tmp_path: Path) -> None:
    assert family_for(proxy_dir).name == "qwen-image"
    flux = index_copy(proxy_dir, tmp_path / "flux", _class_name="FluxPipeline")
    with pytest.raises(ValueError) as err:
        family_for(flux)
    assert "\n" not in str(err.value) and "qwen-image (" in str(err.value)
    other = index_copy(proxy_dir, tmp_path / "t5", text_encoder=["transformers", "T5EncoderModel"])
    with pytest.raises(ValueError, match=r"^[^\n]*the qwen-image family loads Qwen2_5_VLForConditional"):
        load_model(other, prompts=PROMPTS)
    with pytest.raises(ValueError, match="needs a non-empty `prompts:` list"):
        load_model(proxy_dir)
    # Qwen-Image guides (its own norm-rescaled "true CFG"); below 1 is refused as for every family
    check_family_guidance(family_for(proxy_dir), 4.0)
    with pytest.raises(GuidanceError, match=r"must be >= 1\.0"):
        check_family_guidance(family_for(proxy_dir), 0.5)


def test_latent_packing_is_the_transformers_patch_layout(pipe: Any) -> None:
    latents = torch.randn(2, 4, 8, 8)
    packed = pack_latents(latents)
    assert torch.equal(packed, pipe._pack_latents(latents, 2, 4, 8, 8))
    assert torch.equal(unpack_latents(packed, 8, 8), latents)
    assert torch.equal(pipe._unpack_latents(packed, 32, 32, pipe.vae_scale_factor)[:, :, 0], latents)


def test_conditioning_is_qwen_images(model: QwenImageFlowModel, pipe: Any) -> None:
    """The template's prefix is 34 real Qwen2 tokens (special tokens included); after it the
    encodings equal the pipeline's encode_prompt bit for bit, zero-padded to the model's text length."""
    prefix = pipe.tokenizer(PROMPT_TEMPLATE.split("{}")[0]).input_ids
    assert len(prefix) == TEMPLATE_PREFIX_TOKENS
    assert prefix[0] == pipe.tokenizer.convert_tokens_to_ids("<|im_start|>")
    ours = model.encode_prompts(torch.tensor([1, 0, 2]))
    assert isinstance(ours, QwenImageEncodings) and ours.sequence.shape == (3, 32, 16)
    for row, text in enumerate((PROMPTS[1], PROMPTS[0], PROMPTS[2])):
        with torch.no_grad():
            theirs, mask = pipe.encode_prompt(prompt=text, max_sequence_length=32)
        assert mask is None  # one prompt: no padding in the pipeline
        n = theirs.shape[1]
        suffix = len(pipe.tokenizer("<|im_end|>\n<|im_start|>assistant\n").input_ids)
        assert n == len(pipe.tokenizer(text).input_ids) + suffix, text
        assert torch.equal(ours.sequence[row, :n], theirs[0]), text
        assert not ours.sequence[row, n:].any() and int(ours.mask[row].sum()) == n


def test_schedule_and_the_ode_path_are_the_pipelines(model: QwenImageFlowModel, pipe: Any) -> None:
    """Same initial noise, no guidance: the Euler ODE through our velocity gives the pipeline's
    final latents and images (float tolerance: our text is zero-padded and masked, the pipeline's is
    not padded), over the pipeline's own sigmas (dynamic shift included)."""
    steps = 4
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    texts = [PROMPTS[0], PROMPTS[2]]  # different lengths: the pipeline pads these two with a mask
    with torch.no_grad():
        theirs = pipe(
            prompt=texts,
            latents=pack_latents(noise),
            num_inference_steps=steps,
            height=32,
            width=32,
            max_sequence_length=32,
            output_type="latent",
        ).images
    sigmas = model.timestep_schedule(steps)
    assert torch.equal(sigmas, pipe.scheduler.sigmas.float())
    assert float(sigmas[-2]) == pytest.approx(0.02)  # Qwen-Image's shift_terminal
    x = noise
    enc = model.encode_prompts(torch.tensor([0, 2]))
    with torch.no_grad():
        for i in range(steps):
            v = model(x, sigmas[i].expand(2), enc)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    ours = x
    torch.testing.assert_close(ours, unpack_latents(theirs, 8, 8), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        images = pipe(
            prompt=texts,
            latents=pack_latents(noise),
            num_inference_steps=steps,
            height=32,
            width=32,
            max_sequence_length=32,
            output_type="pt",
        ).images
    torch.testing.assert_close(model.to_images(ours), images, rtol=1e-5, atol=1e-5)
    assert images.shape == (2, 3, 32, 32)


@torch.no_grad()
def test_guidance_is_the_pipelines_true_cfg(model: QwenImageFlowModel, pipe: Any) -> None:
    """diffusers' QwenImagePipeline at true_cfg_scale=w against the negative prompt " " (its examples'
    choice; without a negative prompt it does not guide), from the same starting latents: its first
    Euler step equals ours with our guided velocity, within float rounding (its two branches are two
    forward passes over texts padded to their own lengths, ours one of 2B over zero-padded, masked
    texts); the guided velocity keeps the conditional velocity's per-token norm, and differs from the
    plain classifier-free combination. The engine's guided log-probabilities are the trainer's
    re-scoring bit for bit."""
    w = 4.0
    x0 = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(7))
    seen: dict[str, torch.Tensor] = {}

    pipe(
        prompt=PROMPTS[2],
        negative_prompt=" ",
        true_cfg_scale=w,
        latents=pack_latents(x0),
        num_inference_steps=4,
        height=32,
        width=32,
        max_sequence_length=32,
        output_type="latent",
        callback_on_step_end=first_step_recorder(seen),
        callback_on_step_end_tensor_inputs=["latents"],
    )
    sigmas = model.timestep_schedule(4)
    s0, s1 = float(sigmas[0]), float(sigmas[1])
    t = torch.full((1,), s0)
    v = guided_velocity(model, x0, t, torch.tensor([2]), w)
    torch.testing.assert_close(unpack_latents(seen["latents"], 8, 8), x0 + (s1 - s0) * v, rtol=0, atol=1e-5)
    v_cond = model(x0, t, torch.tensor([2]))
    v_uncond = model(x0, t, model.encode_texts([" "]))
    norms = [pack_latents(u).norm(dim=-1) for u in (v, v_cond)]
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)
    plain = v_uncond + w * (v_cond - v_uncond)
    assert (plain - v).abs().max() > 1e-2 and (v - v_cond).abs().max() > 1e-3
    guided = SamplerConfig(num_steps=4, noise_level=0.7, guidance_scale=w)
    prompts = torch.tensor([0, 2])
    trajectory = sample_seeded(model, prompts, [5, 6], guided, encoded=model.encode_prompts(prompts))
    for step in range(guided.num_steps):
        rescored, _, _ = step_log_prob(model, trajectory, step, guided.noise_level, w)
        assert torch.equal(rescored, trajectory.log_probs[:, step]), step


def test_sampler_log_probs_equal_the_trainers_rescoring(model: QwenImageFlowModel) -> None:
    engine = check_log_probs_equal_the_trainers_rescoring(model, (4, 5, 4, 8, 8))
    check_a_prompts_velocity_ignores_its_batch(model, engine)


def test_only_the_transformer_trains(proxy_dir: Path) -> None:
    check_only_the_transformer_trains(proxy_dir, PROMPTS, QwenImageFlowModel)


def test_one_driver_iteration_of_each_recipe_prints_its_level(
    proxy_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The proxy recipe, and the real one (BF16 with FP32 modules named on Qwen-Image's
    transformer) pointed at the proxy's directory, one iteration each through the driver."""
    check_one_driver_iteration_of_each_recipe("qwen_image", proxy_dir, tmp_path, capsys)
