"""The Wan 2.x text-to-video family on its scaled-down proxy (builtin:tiny-wan): the directory picks
its family, the conditioning is Wan's (checked against diffusers' own WanPipeline), the sampler's
log-probabilities over [C, F, h, w] video latents are the trainer's re-scoring bit for bit, only the
transformer trains, the driver runs the proxy recipe, and the core path accepts the family
(test_core_families.py runs it through miles run)."""

from __future__ import annotations

import json
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
    frozen_state,
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


# ----------------------------------------------------------------------------- Wan 2.2 TI2V-5B

GUIDANCE = 4.5


@pytest.fixture(scope="module")
def ti2v_dir() -> Path:
    from miles_diffusion.train import resolve_model_dir

    return resolve_model_dir("builtin:tiny-wan22-ti2v")


@pytest.fixture(scope="module")
def ti2v(ti2v_dir: Path) -> WanFlowModel:
    loaded = load_model(ti2v_dir, prompts=PROMPTS)
    assert isinstance(loaded, WanFlowModel)
    return loaded


def _wan_pipeline(directory: Path) -> Any:
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(str(directory), dtype=torch.float32)


def _pipeline_latents(pipe: Any, x0: torch.Tensor, steps: int, guidance: float, stop: int | None) -> Any:
    """diffusers' WanPipeline on the TI2V proxy's 5 frames of 32x32 from latents ``x0``: the latents
    after each of its steps (all ``steps``, or the first ``stop``) and its decoded video."""
    seen: list[torch.Tensor] = []

    def record(pipeline: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        seen.append(kwargs["latents"].clone())
        if stop is not None and i + 1 >= stop:
            pipeline._interrupt = True
        return kwargs

    out = pipe(
        prompt=PROMPTS[1],
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=x0.clone(),
        height=32,
        width=32,
        num_frames=5,
        output_type="pt" if stop is None else "latent",
        callback_on_step_end=record,
        callback_on_step_end_tensor_inputs=["latents"],
    )
    return seen, out.frames


def test_ti2v_loads_with_per_token_timesteps(ti2v: WanFlowModel, ti2v_dir: Path) -> None:
    """A TI2V directory (expand_timesteps) is a wan one; its latents are [8, 3, 4, 4] (the patchified
    VAE's spatial factor 8, latent width 8), and its transformer is called with one timestep per video
    token (12: 3 frames x 2 x 2 patches), each row's own t on all of them, as WanPipeline calls it."""
    assert family_for(ti2v_dir).name == "wan" and ti2v.expand_timesteps
    assert ti2v.latent_shape == (8, 3, 4, 4)
    seen: list[torch.Tensor] = []
    hook = ti2v.transformer.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(kwargs["timestep"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            ti2v(torch.randn(2, 8, 3, 4, 4), torch.tensor([0.25, 0.75]), torch.tensor([0, 1]))
    finally:
        hook.remove()
    (timestep,) = seen
    assert timestep.shape == (2, 12)
    assert torch.equal(timestep, torch.tensor([[250.0] * 12, [750.0] * 12]))


@torch.no_grad()
def test_ti2v_ode_path_and_video_are_wan_pipelines(ti2v: WanFlowModel, ti2v_dir: Path) -> None:
    """diffusers' WanPipeline on the TI2V proxy, 4 steps unguided from the same latents: its schedule
    is ours bit for bit, its latents after every step are our Euler ODE's within float rounding, and
    its decoded video (the patchified residual VAE) is ours from its final latents."""
    pipe = _wan_pipeline(ti2v_dir)
    assert pipe.config.expand_timesteps
    x0 = torch.randn((1, *ti2v.latent_shape), generator=torch.Generator().manual_seed(7))
    seen, frames = _pipeline_latents(pipe, x0, 4, 1.0, None)
    times = ti2v.timestep_schedule(4)
    pipe.scheduler.set_timesteps(4)
    assert torch.equal(times, pipe.scheduler.sigmas.float())
    x, prompt = x0, torch.tensor([1])
    for step in range(4):
        x = x + float(times[step + 1] - times[step]) * ti2v(x, times[step : step + 1], prompt)
        torch.testing.assert_close(seen[step], x, rtol=0, atol=1e-5)
    video = ti2v.to_videos(seen[-1])  # [B, 3, frames, H, W]; the pipeline's "pt" is [B, frames, 3, H, W]
    assert video.shape == (1, 3, 5, 32, 32)
    torch.testing.assert_close(frames.permute(0, 2, 1, 3, 4), video, rtol=0, atol=1e-6)


@torch.no_grad()
def test_ti2v_guided_first_step_is_wan_pipelines(ti2v: WanFlowModel, ti2v_dir: Path) -> None:
    """At guidance_scale 4.5 (negative prompt the empty one) WanPipeline's first step on the TI2V proxy
    is ours with our guided velocity (its two forward passes, our one of 2B: within rounding)."""
    from miles_diffusion.guidance import guided_velocity

    pipe = _wan_pipeline(ti2v_dir)
    x0 = torch.randn((1, *ti2v.latent_shape), generator=torch.Generator().manual_seed(8))
    seen, _ = _pipeline_latents(pipe, x0, 4, GUIDANCE, 1)
    times = ti2v.timestep_schedule(4)
    v = guided_velocity(ti2v, x0, times[:1], torch.tensor([1]), GUIDANCE)
    torch.testing.assert_close(seen[0], x0 + float(times[1] - times[0]) * v, rtol=0, atol=1e-5)
    unguided = x0 + float(times[1] - times[0]) * ti2v(x0, times[:1], torch.tensor([1]))
    assert (seen[0] - unguided).abs().max() > 1e-3


def test_ti2v_log_probs_equal_the_trainers_rescoring(ti2v: WanFlowModel) -> None:
    """Unguided (the engine's form and the driver's) and guided at 4.5, the sampler's log-probs are
    the trainer's re-scoring bit for bit at every step; the videos decode to 5 frames of 32x32."""
    from miles_diffusion.sampler import SamplerConfig, sample_seeded, step_log_prob

    engine = check_log_probs_equal_the_trainers_rescoring(ti2v, (4, 5, 8, 3, 4, 4))
    assert ti2v.to_images(engine.latents[:, -1]).shape == (4, 3, 32, 5 * 32)
    guided = SamplerConfig(num_steps=4, noise_level=0.7, guidance_scale=GUIDANCE)
    trajectory = sample_seeded(ti2v, torch.tensor([2, 0, 2, 1]), [1, 2, 3, 4], guided)
    for step in range(4):
        with torch.no_grad():
            rescored, _, _ = step_log_prob(ti2v, trajectory, step, 0.7, GUIDANCE)
        assert torch.equal(rescored, trajectory.log_probs[:, step]), step


def test_ti2v_only_the_transformer_trains(ti2v_dir: Path) -> None:
    check_only_the_transformer_trains(ti2v_dir, PROMPTS, WanFlowModel)


# ----------------------------------------------------------------------------- Wan 2.2 A14B


@pytest.fixture(scope="module")
def a14b_dir() -> Path:
    from miles_diffusion.train import resolve_model_dir

    return resolve_model_dir("builtin:tiny-wan22-a14b")


@pytest.fixture(scope="module")
def a14b(a14b_dir: Path) -> WanFlowModel:
    loaded = load_model(a14b_dir, prompts=PROMPTS)
    assert isinstance(loaded, WanFlowModel)
    return loaded


def _expert_calls(model: WanFlowModel) -> tuple[list[int], list[Any]]:
    """Which expert ran, call by call (1: transformer, 2: transformer_2), and the hooks to remove."""
    calls: list[int] = []
    hooks = [
        module.register_forward_pre_hook(lambda *_a, n=n: calls.append(n))
        for n, module in ((1, model.transformer), (2, model.transformer_2))
    ]
    return calls, hooks


def test_a14b_loads_two_experts(a14b: WanFlowModel, a14b_dir: Path, proxy_dir: Path) -> None:
    """A two-expert directory is a wan one: both experts are submodules (in the state dict, so both
    train), the high-noise one is tiny-wan's transformer, the low-noise one its own weights; the
    switch is at boundary_ratio x 1000 = 875."""
    assert family_for(a14b_dir).name == "wan" and a14b.boundary_timestep == 875.0
    names = set(a14b.state_dict())
    assert all(n.startswith(("transformer.", "transformer_2.")) for n in names)
    assert {n.removeprefix("transformer_2.") for n in names if n.startswith("transformer_2.")} == {
        n.removeprefix("transformer.") for n in names if n.startswith("transformer.")
    }
    one = load_model(proxy_dir, prompts=PROMPTS)
    first = a14b.transformer.state_dict()
    assert all(torch.equal(v, first[k]) for k, v in one.transformer.state_dict().items())
    second = a14b.transformer_2.state_dict()
    assert any(not torch.equal(v, second[k]) for k, v in first.items())


def test_a14b_bad_directories_are_refused(a14b_dir: Path, tmp_path: Path) -> None:
    from miles_diffusion.wan import _check_index

    index = json.loads((a14b_dir / "model_index.json").read_text())
    with pytest.raises(ValueError, match=r"boundary_ratio 1\.5; a two-expert"):
        _check_index({**index, "boundary_ratio": 1.5}, tmp_path)
    with pytest.raises(ValueError, match="names None for 'transformer_2'"):
        _check_index({**index, "transformer_2": None}, tmp_path)


@torch.no_grad()
@pytest.mark.parametrize("guidance", [1.0, GUIDANCE])
def test_a14b_steps_are_wan_pipelines(a14b: WanFlowModel, a14b_dir: Path, guidance: float) -> None:
    """diffusers' WanPipeline on the A14B proxy, 4 steps (sigmas 1, 0.858, 0.602, 0.009: the first on
    the high-noise expert, the rest on the low-noise one) from the same latents, unguided and at 4.5
    (its guidance_scale_2 defaulting to the same): its latents after each step are our Euler ODE's
    within float rounding, and ours ran the expert it ran at each step."""
    from miles_diffusion.guidance import guided_velocity

    pipe = _wan_pipeline(a14b_dir)
    assert pipe.config.boundary_ratio == 0.875 and pipe.transformer_2 is not None
    x0 = torch.randn((1, *a14b.latent_shape), generator=torch.Generator().manual_seed(9))
    seen: list[torch.Tensor] = []

    def record(pipeline: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        seen.append(kwargs["latents"].clone())
        return kwargs

    pipe(
        prompt=PROMPTS[1],
        num_inference_steps=4,
        guidance_scale=guidance,
        latents=x0.clone(),
        height=16,
        width=16,
        num_frames=5,
        output_type="latent",
        callback_on_step_end=record,
        callback_on_step_end_tensor_inputs=["latents"],
    )
    times = a14b.timestep_schedule(4)
    calls, hooks = _expert_calls(a14b)
    try:
        x = x0
        for step in range(4):
            v = guided_velocity(a14b, x, times[step : step + 1], torch.tensor([1]), guidance)
            x = x + float(times[step + 1] - times[step]) * v
            torch.testing.assert_close(seen[step], x, rtol=0, atol=1e-5)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [1, 2, 2, 2]  # guided: one forward of 2B a step


@torch.no_grad()
def test_a14b_rows_on_each_side_of_the_boundary(a14b: WanFlowModel) -> None:
    """Rows of one call on both sides of the boundary each get their own expert: equal to each row
    alone (which runs that expert only)."""
    x = torch.randn((3, *a14b.latent_shape), generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.9, 0.5, 0.875])
    prompts = torch.tensor([0, 1, 2])
    together = a14b(x, t, prompts)
    for row, expert in ((0, 1), (1, 2), (2, 1)):
        calls, hooks = _expert_calls(a14b)
        try:
            alone = a14b(x[row : row + 1], t[row : row + 1], prompts[row : row + 1])
        finally:
            for hook in hooks:
                hook.remove()
        assert calls == [expert]
        torch.testing.assert_close(alone, together[row : row + 1], rtol=0, atol=1e-6)


def test_a14b_log_probs_and_both_experts_train(a14b: WanFlowModel, a14b_dir: Path) -> None:
    """The sampler's log-probs are re-scored bit for bit on both sides; a Flow-GRPO step on steps 0
    (high-noise) and 2 (low-noise) optimizes and changes both experts and leaves the frozen parts."""
    from miles_diffusion.flow_grpo import FlowGRPOConfig
    from miles_diffusion.objectives import TrainerConfig
    from miles_diffusion.sampler import SamplerConfig, sample
    from miles_diffusion.trainer import FlowGRPOTrainer

    check_log_probs_equal_the_trainers_rescoring(a14b, (4, 5, 4, 3, 4, 4))
    model = load_model(a14b_dir, prompts=PROMPTS)
    assert isinstance(model, WanFlowModel)
    frozen = frozen_state(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = FlowGRPOTrainer(model, FlowGRPOConfig(clip_range=0.05), TrainerConfig(lr=1e-2), 0.7)
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in model.parameters()}
    trajectory = sample(
        model, torch.tensor([0, 0, 1, 1]), SamplerConfig(num_steps=4), torch.Generator().manual_seed(1)
    )
    stats = trainer.train_step(trajectory, torch.tensor([1.0, -1.0, 0.5, -0.5]), [0, 2])
    assert stats["grad_norm"] > 0
    changed = {k.split(".")[0] for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"transformer", "transformer_2"}
    after = frozen_state(model)
    assert all(torch.equal(after[k], frozen[k]) for k in frozen)


def test_a14b_driver_iteration_and_refusals(
    a14b: WanFlowModel, a14b_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The package driver runs the Wan proxy recipe on the A14B proxy; the core path (miles run: by
    built-in name and by directory), LoRA and FSDP ranks refuse it in one line before anything starts."""
    import dataclasses

    from miles.config import load_recipe
    from miles.driver.preflight import preflight
    from miles.errors import ConfigError
    from miles_diffusion import lora
    from miles_diffusion.families import check_core_path
    from miles_diffusion.recipe import load_recipe as load_driver_recipe
    from miles_diffusion.train import main, run

    main(
        [
            "wan_flow_grpo_proxy",
            "--model",
            "builtin:tiny-wan22-a14b",
            "--iterations",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert "train/loss" in json.loads((tmp_path / "metrics.jsonl").read_text())
    capsys.readouterr()
    refused = (
        r"a two-expert Wan 2\.2 directory \(transformer_2 / boundary_ratio\); {} handles one transformer"
    )
    core = refused.format(r"the core path \(miles run\)")
    with pytest.raises(ValueError, match=core) as err:
        check_core_path(a14b_dir)
    assert "\n" not in str(err.value)
    for ref in ("builtin:tiny-wan22-a14b", str(a14b_dir)):
        with pytest.raises(ConfigError, match=core):
            preflight(load_recipe("wan_flow_grpo_proxy", [f"model.path={ref}"]))
    with pytest.raises(ValueError, match=refused.format("LoRA")):
        lora.adapter_root(a14b)
    recipe = load_driver_recipe("wan_flow_grpo_proxy")
    recipe = dataclasses.replace(
        recipe, model="builtin:tiny-wan22-a14b", trainer=dataclasses.replace(recipe.trainer, fsdp_ranks=2)
    )
    with pytest.raises(ValueError, match=refused.format(r"FSDP \(fsdp_ranks\)")):
        run(recipe)
