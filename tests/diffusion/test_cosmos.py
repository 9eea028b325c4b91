"""The Cosmos-Predict2 family on its scaled-down proxy (builtin:tiny-cosmos): the directory picks its
family, diffusers' own Cosmos2TextToImagePipeline loads the proxy (with a pass-through stand-in for
its required safety checker), the conditioning is the pipeline's T5 encoding bit for bit, the
schedule is its Karras sigmas as rectified-flow times, the transformer's output is the flow velocity
(the EDM preconditioning turned around: the deterministic path is the pipeline's), the pipeline's
guidance is the shared one at w + 1, the sampler's log-probabilities are the trainer's re-scoring bit
for bit, only the transformer trains, and the driver runs both recipes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from miles_diffusion.cosmos import (
    DEFAULT_NEGATIVE_PROMPT,
    SIGMA_MAX,
    SIGMA_MIN,
    CosmosEncodings,
    CosmosFlowModel,
    velocity_times,
)
from miles_diffusion.families import check_family_guidance, family_for, load_model
from miles_diffusion.guidance import guided_velocity
from miles_diffusion.sampler import SamplerConfig, sample

from ._family_checks import (
    check_a_prompts_velocity_ignores_its_batch,
    check_log_probs_equal_the_trainers_rescoring,
    check_one_driver_iteration_of_each_recipe,
    check_only_the_transformer_trains,
    index_copy,
    proxy_fixtures,
)

PROMPTS = ("a red cube on a table", "two cats", "punctuation & CAPS! (and a long tail of words)")


class PassThroughChecker:
    """Stands in for cosmos_guardrail's CosmosSafetyChecker, which the pipeline requires to run (it
    refuses None) and which is not installed here: every text is let through, images unchanged."""

    def to(self, *args: Any, **kwargs: Any) -> PassThroughChecker:
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, video: np.ndarray) -> np.ndarray:
        return video


proxy_dir, model = proxy_fixtures("builtin:tiny-cosmos", PROMPTS, CosmosFlowModel)


@pytest.fixture(scope="module")
def pipe(proxy_dir: Path) -> Any:
    from diffusers import Cosmos2TextToImagePipeline

    return Cosmos2TextToImagePipeline.from_pretrained(
        str(proxy_dir), safety_checker=PassThroughChecker(), dtype=torch.float32
    )


def _pipeline_latents(pipe: Any, texts: list[str], noise: torch.Tensor, steps: int, **kw: Any) -> Any:
    with torch.no_grad():
        return pipe(
            prompt=texts,
            latents=noise[:, :, None],  # the pipeline starts at x = sigma_max * noise: z = t0 * noise
            num_inference_steps=steps,
            height=32,
            width=32,
            max_sequence_length=48,
            **kw,
        ).images


def test_the_directory_picks_its_family(proxy_dir: Path, tmp_path: Path) -> None:
    assert family_for(proxy_dir).name == "cosmos"
    world = index_copy(proxy_dir, tmp_path / "world", _class_name="CosmosTextToWorldPipeline")
    with pytest.raises(ValueError) as err:
        family_for(world)
    assert "\n" not in str(err.value) and "cosmos (" in str(err.value)
    other = index_copy(proxy_dir, tmp_path / "umt5", text_encoder=["transformers", "UMT5EncoderModel"])
    with pytest.raises(ValueError, match=r"^[^\n]*the cosmos family loads T5EncoderModel"):
        load_model(other, prompts=PROMPTS)
    with pytest.raises(ValueError, match="needs a non-empty `prompts:` list"):
        load_model(proxy_dir)
    check_family_guidance(family_for(proxy_dir), 8.0)  # the pipeline's CFG is the shared one


def test_a_predict25_transformer_and_a_non_karras_scheduler_are_refused(
    proxy_dir: Path, tmp_path: Path
) -> None:
    import shutil

    for part, key, value, message in (
        ("transformer", "img_context_dim_in", 16, "a Cosmos-Predict2.5 transformer"),
        ("scheduler", "use_karras_sigmas", False, "does not use Karras sigmas"),
    ):
        copy = tmp_path / part
        shutil.copytree(proxy_dir, copy)
        config_file = copy / part / ("config.json" if part == "transformer" else "scheduler_config.json")
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=rf"^[^\n]*{message}"):
            load_model(copy, prompts=PROMPTS)


def test_conditioning_is_the_pipelines_t5_encoding(model: CosmosFlowModel, pipe: Any) -> None:
    """Padded to the fixed text length with the mask, zero past each prompt: the pipeline's own
    encode_prompt bit for bit, whatever else is in the batch."""
    ours = model.encode_prompts(torch.tensor([1, 0, 2]))
    assert isinstance(ours, CosmosEncodings) and ours.sequence.shape == (3, 48, 32)
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(
            prompt=[PROMPTS[1], PROMPTS[0], PROMPTS[2]],
            do_classifier_free_guidance=False,
            max_sequence_length=48,
        )
    assert torch.equal(ours.sequence, theirs)
    lengths = pipe.tokenizer(list(PROMPTS)).input_ids
    for row, index in enumerate((1, 0, 2)):
        n = len(lengths[index])
        assert ours.sequence[row, :n].abs().sum() > 0 and not ours.sequence[row, n:].any()


def test_schedule_and_the_ode_path_are_the_pipelines(model: CosmosFlowModel, pipe: Any) -> None:
    """Same initial noise, no guidance. The schedule is the pipeline's Karras sigmas s as
    t = s / (1 + s) (then 0); the Euler ODE through our velocity from t0 * noise passes through the
    pipeline's latents (z = x / (1 + s)): its final latents (at sigma_min) are ours at t_{N-1} times
    1 + sigma_min, and its images are ours decoded from there (up to its uint8 post-processing)."""
    steps = 5
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
    texts = [PROMPTS[0], PROMPTS[2]]
    theirs = _pipeline_latents(pipe, texts, noise, steps, guidance_scale=1.0, output_type="latent")
    times = model.timestep_schedule(steps)
    sigmas = pipe.scheduler.sigmas.float()
    assert float(sigmas[0]) == SIGMA_MAX and float(sigmas[-2]) == pytest.approx(SIGMA_MIN)
    assert torch.equal(times[:-1], velocity_times(sigmas[:-1])) and float(times[-1]) == 0.0
    assert float(times[0]) == pytest.approx(80 / 81)
    x = noise * times[0]  # the sampler's start (sample() below): z = t0 * noise = x / (1 + s0)
    enc = model.encode_prompts(torch.tensor([0, 2]))
    path = [x]
    with torch.no_grad():
        for i in range(steps):
            v = model(x, times[i].expand(2), enc)
            x = x + (times[i + 1] - times[i]) * v
            path.append(x)
    at_sigma_min = path[steps - 1] * (1.0 + float(sigmas[-2]))
    torch.testing.assert_close(at_sigma_min, theirs, rtol=1e-5, atol=1e-5)
    images = _pipeline_latents(pipe, texts, noise, steps, guidance_scale=1.0, output_type="pt")
    assert images.shape == (2, 3, 32, 32)
    # the pipeline's safety-checker path rounds its images down to 1/255 (uint8) and back
    ours = model.to_images(at_sigma_min)
    assert float((ours - images).min()) >= -1e-5 and float((ours - images).max()) <= 1 / 255 + 1e-5
    # the sampler starts where the pipeline does: its first draw (the same seed) scaled by t0
    trajectory = sample(
        model, torch.tensor([0, 2]), SamplerConfig(num_steps=steps), torch.Generator().manual_seed(3)
    )
    assert torch.equal(trajectory.latents[:, 0], path[0])


def test_the_pipelines_guidance_is_the_shared_one_at_w_plus_one(model: CosmosFlowModel, pipe: Any) -> None:
    """The pipeline guides x_0 with w and its default negative prompt; our guided velocity with
    guidance_scale w + 1 and the same negative prompt gives its latents."""
    steps, w = 3, 4.0
    noise = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    texts = [PROMPTS[1], PROMPTS[0]]
    theirs = _pipeline_latents(pipe, texts, noise, steps, guidance_scale=w, output_type="latent")
    unconditional = model.with_unconditional(torch.tensor([1, 0]))
    assert torch.equal(unconditional[:2].sequence, model.encode_texts([DEFAULT_NEGATIVE_PROMPT] * 2).sequence)
    times = model.timestep_schedule(steps)
    x = noise * times[0]
    enc = model.encode_prompts(torch.tensor([1, 0]))
    with torch.no_grad():
        for i in range(steps - 1):
            v = guided_velocity(model, x, times[i].expand(2), enc, w + 1.0)
            x = x + (times[i + 1] - times[i]) * v
    torch.testing.assert_close(x * (1.0 + SIGMA_MIN), theirs, rtol=1e-5, atol=1e-5)


def test_sampler_log_probs_equal_the_trainers_rescoring(model: CosmosFlowModel) -> None:
    engine = check_log_probs_equal_the_trainers_rescoring(model, (4, 5, 4, 8, 8))
    check_a_prompts_velocity_ignores_its_batch(model, engine)


def test_only_the_transformer_trains(proxy_dir: Path) -> None:
    check_only_the_transformer_trains(proxy_dir, PROMPTS, CosmosFlowModel)


def test_one_driver_iteration_of_each_recipe_prints_its_level(
    proxy_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The proxy recipe, and the real one (BF16 with FP32 modules named on Cosmos's transformer)
    pointed at the proxy's directory, one iteration each through the driver."""
    check_one_driver_iteration_of_each_recipe("cosmos", proxy_dir, tmp_path, capsys)
