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
from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.objectives import TrainerConfig
from miles_diffusion.sampler import SamplerConfig, sample, sample_seeded, step_log_prob
from miles_diffusion.train import main, resolve_model_dir
from miles_diffusion.trainer import FlowGRPOTrainer
from miles_diffusion.wan import WAN_MAX_LENGTH, WanEncodings, WanFlowModel, clean_prompt

PROMPTS = ("a red balloon over a city", "waves  at\tsunset &amp; dusk", "Ünïcode, punctuation & CAPS!")


@pytest.fixture(scope="module")
def proxy_dir() -> Path:
    return resolve_model_dir("builtin:tiny-wan")


@pytest.fixture(scope="module")
def model(proxy_dir: Path) -> WanFlowModel:
    loaded = load_model(proxy_dir, prompts=PROMPTS)
    assert isinstance(loaded, WanFlowModel)
    return loaded


def _index_copy(proxy_dir: Path, dest: Path, **changes: Any) -> Path:
    dest.mkdir()
    index = json.loads((proxy_dir / "model_index.json").read_text())
    (dest / "model_index.json").write_text(json.dumps({**index, **changes}))
    return dest


def test_the_directory_picks_its_family(proxy_dir: Path, tmp_path: Path) -> None:
    assert family_for(proxy_dir).name == "wan"
    flux = _index_copy(proxy_dir, tmp_path / "flux", _class_name="FluxPipeline")
    with pytest.raises(ValueError) as err:
        family_for(flux)
    message = str(err.value)
    assert "\n" not in message and "a diffusers FluxPipeline directory" in message
    assert "wan (" in message and "WanPipeline" in message and "sd3 (" in message
    two = _index_copy(proxy_dir, tmp_path / "a14b", transformer_2=["diffusers", "WanTransformer3DModel"])
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
    prompts = torch.tensor([2, 0, 2, 1])
    distinct, inverse = torch.unique(prompts, return_inverse=True)
    encoded = model.encode_prompts(distinct)[inverse]
    config = SamplerConfig(num_steps=4, noise_level=0.7)
    engine = sample_seeded(model, prompts, [11, 12, 13, 14], config, encoded=encoded)
    driver = sample(model, prompts, config, torch.Generator().manual_seed(0))
    for trajectory in (engine, driver):
        assert trajectory.latents.shape == (4, 5, 4, 3, 4, 4)
        for step in range(config.num_steps):
            with torch.no_grad():
                rescored, _, _ = step_log_prob(model, trajectory, step, config.noise_level)
            assert torch.equal(rescored, trajectory.log_probs[:, step]), step
    videos = model.to_videos(engine.latents[:, -1])
    assert videos.shape == (4, 3, 5, 16, 16)
    images = model.to_images(engine.latents[:, -1])  # each video's frames side by side
    assert images.shape == (4, 3, 16, 80) and 0.0 <= float(images.min()) <= float(images.max()) <= 1.0
    assert torch.equal(images[:, :, :, 16:32], videos[:, :, 1])
    check_attention_backends(model)


def _frozen_state(model: WanFlowModel) -> dict[str, torch.Tensor]:
    return {
        f"{part}.{name}": t.detach().clone()
        for part, module in model.frozen_modules().items()
        for name, t in module.state_dict().items()
    }


def test_only_the_transformer_trains(proxy_dir: Path) -> None:
    model = load_model(proxy_dir, prompts=PROMPTS)
    assert isinstance(model, WanFlowModel)
    assert set(model.frozen_modules()) == {"vae", "text_encoder"}
    assert all(name.startswith("transformer.") for name in model.state_dict())
    frozen_params = [p for m in model.frozen_modules().values() for p in m.parameters()]
    assert frozen_params and not any(p.requires_grad for p in frozen_params)
    frozen_before = _frozen_state(model)
    transformer_before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = FlowGRPOTrainer(model, FlowGRPOConfig(clip_range=0.05), TrainerConfig(lr=1e-2), 0.7)
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in model.transformer.parameters()}
    trajectory = sample(
        model, torch.tensor([0, 0, 1, 1]), SamplerConfig(num_steps=3), torch.Generator().manual_seed(1)
    )
    stats = trainer.train_step(trajectory, torch.tensor([1.0, -1.0, 0.5, -0.5]), [0, 2])
    assert stats["grad_norm"] > 0
    assert all(p.grad is None for p in frozen_params)
    frozen_after = _frozen_state(model)
    assert all(torch.equal(frozen_after[k], frozen_before[k]) for k in frozen_before)
    assert all(not m.training for m in model.frozen_modules().values())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, transformer_before[k])]
    assert len(changed) > len(transformer_before) // 2


def test_one_driver_iteration_of_each_recipe_prints_its_level(
    proxy_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The proxy recipe, and the real one (its BF16 precision with FP32 modules named on Wan's
    transformer) pointed at the proxy's directory, one iteration each through the driver."""
    main(["wan_flow_grpo_proxy", "--iterations", "1", "--out", str(tmp_path / "proxy")])
    assert "recipe wan_flow_grpo_proxy: evidence level proxy gated" in capsys.readouterr().out
    main(["wan_flow_grpo", "--model", str(proxy_dir), "--iterations", "1", "--out", str(tmp_path / "real")])
    assert "recipe wan_flow_grpo: evidence level not verified" in capsys.readouterr().out
    (line,) = (tmp_path / "real" / "metrics.jsonl").read_text().splitlines()
    assert {"reward/mean", "train/loss", "eval/reward_before", "eval/reward_after"} <= set(json.loads(line))


def test_the_core_path_accepts_wan(proxy_dir: Path) -> None:
    """``miles run`` serves the wan family (tests/diffusion/test_core_families.py runs it): the core's
    checks and the component checks pass on the built-in and on its directory (nothing starts)."""
    from miles.config import load_recipe
    from miles.driver.preflight import close_components, preflight

    for ref in ("builtin:tiny-wan", str(proxy_dir)):
        checked = preflight(load_recipe("wan_flow_grpo_proxy", [f"model.path={ref}"]))
        close_components(checked.components)
        assert checked.model_path == str(proxy_dir.resolve())
