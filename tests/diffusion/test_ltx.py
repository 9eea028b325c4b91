"""The LTX-Video family on its scaled-down proxy (builtin:tiny-ltx): the directory picks its family,
diffusers' own LTXPipeline loads the proxy, the conditioning is LTX's (T5 over max-length padded
tokens, the mask kept; bit for bit against the pipeline's encode_prompt), the token layout, the
schedule (dynamic shift from the token count), the deterministic ODE path and the decode are the
pipeline's, unguided and guided, the sampler's log-probabilities are the trainer's re-scoring bit
for bit, only the transformer trains, and the driver runs both recipes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_diffusion.families import check_family_guidance, family_for, load_model
from miles_diffusion.guidance import guided_velocity
from miles_diffusion.ltx import LTXEncodings, LTXFlowModel, from_tokens, to_tokens

from ._family_checks import (
    check_a_prompts_velocity_ignores_its_batch,
    check_log_probs_equal_the_trainers_rescoring,
    check_one_driver_iteration_of_each_recipe,
    check_only_the_transformer_trains,
    index_copy,
    proxy_fixtures,
)

PROMPTS = ("a red cube on a table", "two cats", "waves & rocks at dusk, seen from a cliff!")
SIZE = {"height": 32, "width": 32, "num_frames": 5, "max_sequence_length": 32}


proxy_dir, model = proxy_fixtures("builtin:tiny-ltx", PROMPTS, LTXFlowModel)


@pytest.fixture(scope="module")
def pipe(proxy_dir: Path) -> Any:
    from diffusers import LTXPipeline

    pipe = LTXPipeline.from_pretrained(str(proxy_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ode(model: LTXFlowModel, noise: torch.Tensor, ids: list[int], steps: int, w: float) -> torch.Tensor:
    """The deterministic Euler path through our (guided) velocity over our sigmas."""
    sigmas = model.timestep_schedule(steps)
    x, prompts = noise, torch.tensor(ids)
    with torch.no_grad():
        for i in range(steps):
            v = guided_velocity(model, x, sigmas[i].expand(len(ids)), prompts, w)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def test_the_directory_picks_its_family(proxy_dir: Path, tmp_path: Path) -> None:
    assert family_for(proxy_dir).name == "ltx"
    other = index_copy(proxy_dir, tmp_path / "umt5", text_encoder=["transformers", "UMT5EncoderModel"])
    with pytest.raises(ValueError, match=r"^[^\n]*the ltx family loads T5EncoderModel \(transformers\)$"):
        load_model(other, prompts=PROMPTS)
    with pytest.raises(ValueError, match="needs a non-empty `prompts:` list"):
        load_model(proxy_dir)
    # a patching transformer: a full copy with patch_size 2 is refused in one line
    import shutil

    patched = tmp_path / "patched"
    shutil.copytree(proxy_dir, patched)
    config = json.loads((patched / "transformer" / "config.json").read_text())
    (patched / "transformer" / "config.json").write_text(json.dumps({**config, "patch_size": 2}))
    with pytest.raises(ValueError, match=r"^[^\n]*one token per latent voxel \(patch sizes 1\)$"):
        load_model(patched, prompts=PROMPTS)
    (patched / "transformer" / "config.json").write_text(json.dumps(config))
    vae_config = json.loads((patched / "vae" / "config.json").read_text())
    noisy = {**vae_config, "decoder_inject_noise": [False, False, True]}
    (patched / "vae" / "config.json").write_text(json.dumps(noisy))
    with pytest.raises(ValueError, match=r"^[^\n]*injects random noise while decoding[^\n]*$"):
        load_model(patched, prompts=PROMPTS)
    (patched / "vae" / "config.json").write_text(json.dumps(vae_config))
    (patched / "miles_video.json").write_text(json.dumps({"num_frames": 6}))
    with pytest.raises(ValueError, match=r"^[^\n]*needs 1 \+ a multiple of 2 frames[^\n]*$"):
        load_model(patched, prompts=PROMPTS)
    # LTXPipeline's guidance is the shared CFG: a scale above 1 is accepted before loading
    check_family_guidance(family_for(proxy_dir), 3.0)


def test_the_token_layout_is_the_pipelines(pipe: Any) -> None:
    latents = torch.randn(2, 8, 3, 4, 4)
    tokens = to_tokens(latents)
    assert tokens.shape == (2, 48, 8)
    assert torch.equal(tokens, pipe._pack_latents(latents, 1, 1))
    assert torch.equal(from_tokens(tokens, 3, 4, 4), latents)
    assert torch.equal(pipe._unpack_latents(tokens, 3, 4, 4, 1, 1), latents)


def test_conditioning_is_ltxs(model: LTXFlowModel, pipe: Any) -> None:
    """Each prompt's encodings and mask equal the pipeline's encode_prompt at the same text length
    bit for bit, and the empty prompt (the unconditional branch) its default negative prompt's."""
    ours = model.encode_prompts(torch.tensor([1, 0, 2]))
    assert isinstance(ours, LTXEncodings) and ours.sequence.shape == (3, 32, 32)
    with torch.no_grad():
        theirs, mask, neg, neg_mask = pipe.encode_prompt(
            prompt=[PROMPTS[1], PROMPTS[0], PROMPTS[2]],
            do_classifier_free_guidance=True,
            max_sequence_length=32,
        )
    assert torch.equal(ours.sequence, theirs) and torch.equal(ours.mask, mask.long())
    assert int(ours.mask[0].sum()) == len(PROMPTS[1].replace(" ", "")) + 1  # characters and </s>
    null = model.encode_texts([""])
    assert torch.equal(null.sequence, neg[:1]) and torch.equal(null.mask, neg_mask[:1].long())


@pytest.mark.parametrize("w", [1.0, 3.0])
def test_schedule_the_ode_path_and_the_decode_are_the_pipelines(
    model: LTXFlowModel, pipe: Any, w: float
) -> None:
    """Same initial noise: the Euler ODE through our velocity (guided as LTXPipeline guides at w = 3:
    the empty negative prompt, v_u + w (v_c - v_u)) gives the pipeline's final latents and frames over
    its own sigmas (dynamic shift from the 48 video tokens, shift_terminal 0.1)."""
    steps = 4
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    texts = [PROMPTS[0], PROMPTS[2]]
    with torch.no_grad():
        theirs = pipe(
            prompt=texts,
            latents=to_tokens(noise),
            num_inference_steps=steps,
            guidance_scale=w,
            output_type="latent",
            **SIZE,
        ).frames
    sigmas = model.timestep_schedule(steps)
    assert torch.equal(sigmas, pipe.scheduler.sigmas.float())
    assert float(sigmas[-2]) == pytest.approx(0.1)  # LTX's shift_terminal
    ours = _ode(model, noise, [0, 2], steps, w)
    torch.testing.assert_close(ours, from_tokens(theirs, 3, 4, 4), rtol=1e-5, atol=1e-5)
    if w == 1.0:
        assert (ours - _ode(model, noise, [0, 2], steps, 3.0)).abs().max() > 1e-3
        with torch.no_grad():
            frames = pipe(
                prompt=texts,
                latents=to_tokens(noise),
                num_inference_steps=steps,
                guidance_scale=w,
                output_type="pt",
                **SIZE,
            ).frames  # [B, frames, 3, H, W]
        images = model.to_images(ours)
        assert images.shape == (2, 3, 32, 5 * 32)
        strip = frames.permute(0, 2, 3, 1, 4).reshape(2, 3, 32, 5 * 32)
        torch.testing.assert_close(images, strip, rtol=1e-5, atol=1e-5)


def test_sampler_log_probs_equal_the_trainers_rescoring(model: LTXFlowModel) -> None:
    engine = check_log_probs_equal_the_trainers_rescoring(model, (4, 5, 8, 3, 4, 4))
    check_a_prompts_velocity_ignores_its_batch(model, engine)


def test_only_the_transformer_trains(proxy_dir: Path) -> None:
    check_only_the_transformer_trains(proxy_dir, PROMPTS, LTXFlowModel)


def test_one_driver_iteration_of_each_recipe_prints_its_level(
    proxy_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The proxy recipe, and the real one (BF16 with FP32 modules named on LTX's transformer)
    pointed at the proxy's directory, one iteration each through the driver."""
    check_one_driver_iteration_of_each_recipe("ltx", proxy_dir, tmp_path, capsys)
