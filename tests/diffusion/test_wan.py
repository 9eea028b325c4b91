"""The Wan 2.x text-to-video family on its scaled-down proxy (builtin:tiny-wan): the directory picks
its family, the conditioning is Wan's (checked against diffusers' own WanPipeline), the sampler's
log-probabilities over [C, F, h, w] video latents are the trainer's re-scoring bit for bit, only the
transformer trains, the driver runs the proxy recipe, and the core path accepts the family
(test_core_families.py runs it through miles run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles_diffusion.deterministic import check_attention_backends
from miles_diffusion.families import family_for, load_model
from miles_diffusion.wan import WAN_MAX_LENGTH, WanEncodings, WanFlowModel, clean_prompt

from ._family_checks import (
    check_log_probs_equal_the_trainers_rescoring,
    check_one_driver_iteration_of_each_recipe,
    check_only_the_transformer_trains,
    index_copy,
    proxy_fixtures,
)

PROMPTS = ("a red balloon over a city", "waves  at\tsunset &amp; dusk", "Ünïcode, punctuation & CAPS!")


proxy_dir, model = proxy_fixtures("builtin:tiny-wan", PROMPTS, WanFlowModel)


def test_the_directory_picks_its_family(proxy_dir: Path, tmp_path: Path) -> None:
    assert family_for(proxy_dir).name == "wan"
    flux = index_copy(proxy_dir, tmp_path / "flux", _class_name="FluxPipeline")
    with pytest.raises(ValueError) as err:
        family_for(flux)
    message = str(err.value)
    assert "\n" not in message and "a diffusers FluxPipeline directory" in message
    assert "wan (" in message and "WanPipeline" in message and "sd3 (" in message
    two = index_copy(proxy_dir, tmp_path / "a14b", transformer_2=["diffusers", "WanTransformer3DModel"])
    with pytest.raises(ValueError, match=r"two-expert Wan 2\.2 directory"):
        load_model(two, prompts=PROMPTS)
    with pytest.raises(ValueError, match="needs a non-empty `prompts:` list"):
        load_model(proxy_dir)


def test_conditioning_and_schedule_are_wans(model: WanFlowModel, proxy_dir: Path) -> None:
    """diffusers' own WanPipeline loads the proxy directory, and its encode_prompt (at the pipeline
    call's default 512 tokens) gives our encodings bit for bit; its scheduler's sigmas are ours."""
    from diffusers import WanPipeline

    pipe: Any = WanPipeline.from_pretrained(str(proxy_dir), dtype=torch.float32)
    ours = model.encode_prompts(torch.tensor([1, 0, 2]))
    assert isinstance(ours, WanEncodings) and ours.sequence.shape == (3, WAN_MAX_LENGTH, 32)
    for row, text in enumerate((PROMPTS[1], PROMPTS[0], PROMPTS[2])):
        with torch.no_grad():
            theirs, _ = pipe.encode_prompt(
                prompt=text, do_classifier_free_guidance=False, max_sequence_length=WAN_MAX_LENGTH
            )
        assert torch.equal(ours.sequence[row : row + 1], theirs), text
        real = int(sum(pipe.tokenizer(clean_prompt(text)).attention_mask))
        assert 0 < real < WAN_MAX_LENGTH  # states of the prompt's own tokens, zeros past them
        assert ours.sequence[row, :real].abs().sum(dim=-1).gt(0).all()
        assert not ours.sequence[row, real:].any()
    pipe.scheduler.set_timesteps(8)
    assert torch.equal(model.timestep_schedule(8), pipe.scheduler.sigmas.float())
    assert model.latent_shape == (4, 3, 4, 4)


def test_sampler_log_probs_equal_the_trainers_rescoring(model: WanFlowModel) -> None:
    engine = check_log_probs_equal_the_trainers_rescoring(model, (4, 5, 4, 3, 4, 4))
    videos = model.to_videos(engine.latents[:, -1])
    assert videos.shape == (4, 3, 5, 16, 16)
    images = model.to_images(engine.latents[:, -1])  # each video's frames side by side
    assert images.shape == (4, 3, 16, 80) and 0.0 <= float(images.min()) <= float(images.max()) <= 1.0
    assert torch.equal(images[:, :, :, 16:32], videos[:, :, 1])
    check_attention_backends(model)


def test_only_the_transformer_trains(proxy_dir: Path) -> None:
    check_only_the_transformer_trains(proxy_dir, PROMPTS, WanFlowModel)


def test_one_driver_iteration_of_each_recipe_prints_its_level(
    proxy_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The proxy recipe, and the real one (its BF16 precision with FP32 modules named on Wan's
    transformer) pointed at the proxy's directory, one iteration each through the driver."""
    check_one_driver_iteration_of_each_recipe("wan", proxy_dir, tmp_path, capsys)


def test_the_core_path_accepts_wan(proxy_dir: Path) -> None:
    """``miles run`` serves the wan family (tests/diffusion/test_core_families.py runs it): the core's
    checks and the component checks pass on the built-in and on its directory (nothing starts)."""
    from miles.config import load_recipe
    from miles.driver.preflight import close_components, preflight

    for ref in ("builtin:tiny-wan", str(proxy_dir)):
        checked = preflight(load_recipe("wan_flow_grpo_proxy", [f"model.path={ref}"]))
        close_components(checked.components)
        assert checked.model_path == str(proxy_dir.resolve())
