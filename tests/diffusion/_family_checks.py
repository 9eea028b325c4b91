"""Checks every diffusers-pipeline family's tests make alike (Wan, Qwen-Image, LTX-Video, Cosmos):
the sampler's log-probabilities re-scored by the trainer, a prompt's velocity independent of its
batch, only the transformer training, and one driver iteration of the proxy and the real recipe;
the modules' ``proxy_dir`` and ``model`` fixtures (:func:`proxy_fixtures`) and index-only copies
(:func:`index_copy`); and what the core tests check of an engine alike for every pipeline family,
SD3 included (re-scoring its batch, loading a trainer's export). Each family's test module calls
them with its own shapes and names; what is the family's own (conditioning, schedule, decode
against diffusers) stays in that module."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import torch

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.deterministic import check_attention_backends
from miles_diffusion.families import load_model
from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.objectives import TrainerConfig
from miles_diffusion.pipeline_model import PipelineFlowModel
from miles_diffusion.sampler import SamplerConfig, Trajectory, sample, sample_seeded, step_log_prob
from miles_diffusion.train import resolve_model_dir
from miles_diffusion.trainer import FlowGRPOTrainer

if TYPE_CHECKING:
    from miles_diffusion.engine.server import DiffusionEngine
    from miles_diffusion.wire import TrajectoryBatch

Model = TypeVar("Model", bound=PipelineFlowModel)

RESCORED_PROMPTS = torch.tensor([2, 0, 2, 1])
"""The prompt ids the re-scoring check samples (a repeated one, so the engine's form reuses rows)."""


def proxy_fixtures(
    builtin: str, prompts: tuple[str, ...], model_type: type[Model]
) -> tuple[Callable[[], Path], Callable[[Path], Model]]:
    """A family test module's module-scoped fixtures, to bind to the names they serve under
    (``proxy_dir, model = proxy_fixtures(...)``): ``proxy_dir``, the ``builtin`` proxy's directory,
    and ``model``, the proxy loaded through the family registry with ``prompts`` (a ``model_type``)."""

    @pytest.fixture(scope="module", name="proxy_dir")
    def proxy_dir_fixture() -> Path:
        return resolve_model_dir(builtin)

    @pytest.fixture(scope="module", name="model")
    def model_fixture(proxy_dir: Path) -> Model:
        loaded = load_model(proxy_dir, prompts=prompts)
        assert isinstance(loaded, model_type)
        return loaded

    return proxy_dir_fixture, model_fixture


def index_copy(proxy_dir: Path, dest: Path, **changes: Any) -> Path:
    """A new directory ``dest`` holding the proxy's ``model_index.json`` alone, with ``changes``:
    enough for the family registry to pick (or refuse) a family by it."""
    dest.mkdir()
    index = json.loads((proxy_dir / "model_index.json").read_text())
    (dest / "model_index.json").write_text(json.dumps({**index, **changes}))
    return dest


def check_log_probs_equal_the_trainers_rescoring(
    model: PipelineFlowModel, latents_shape: tuple[int, ...]
) -> Trajectory:
    """The engine's form (prompts encoded once, rows reused, per-trajectory seeds) and the driver's
    form (ids) both give log-probabilities the trainer re-scores bit for bit at every step; each
    trajectory's latents are ``latents_shape``. Returns the engine's trajectory."""
    prompts = RESCORED_PROMPTS
    distinct, inverse = torch.unique(prompts, return_inverse=True)
    encoded = model.encode_prompts(distinct)[inverse]
    config = SamplerConfig(num_steps=4, noise_level=0.7)
    engine = sample_seeded(model, prompts, [11, 12, 13, 14], config, encoded=encoded)
    driver = sample(model, prompts, config, torch.Generator().manual_seed(0))
    for trajectory in (engine, driver):
        assert trajectory.latents.shape == latents_shape
        for step in range(config.num_steps):
            with torch.no_grad():
                rescored, _, _ = step_log_prob(model, trajectory, step, config.noise_level)
            assert torch.equal(rescored, trajectory.log_probs[:, step]), step
    return engine


def check_a_prompts_velocity_ignores_its_batch(model: PipelineFlowModel, engine: Trajectory) -> None:
    """A fixed text length makes a prompt's velocity independent of its batch: one row alone equals
    it within a batch (the engine samples a group, the trainer re-scores a mixed batch)."""
    prompts = RESCORED_PROMPTS
    x, t = engine.latents[:, 1], torch.full((4,), 0.5)
    with torch.no_grad():
        together = model(x, t, prompts)
        alone = model(x[1:2], t[1:2], prompts[1:2])
    torch.testing.assert_close(alone, together[1:2], rtol=0, atol=1e-6)
    check_attention_backends(model)


def frozen_state(model: PipelineFlowModel) -> dict[str, torch.Tensor]:
    """A copy of every frozen part's weights, by ``part.name``: what training must leave as it was."""
    return {
        f"{part}.{name}": t.detach().clone()
        for part, module in model.frozen_modules().items()
        for name, t in module.state_dict().items()
    }


def check_only_the_transformer_trains(
    proxy_dir: Path, prompts: tuple[str, ...], model_type: type[PipelineFlowModel]
) -> None:
    """Loaded from ``proxy_dir``, the model holds only the transformer's weights; a Flow-GRPO step
    optimizes and changes them alone, and leaves the frozen VAE and text encoder as they were."""
    model = load_model(proxy_dir, prompts=prompts)
    assert isinstance(model, model_type)
    assert set(model.frozen_modules()) == {"vae", "text_encoder"}
    assert all(name.startswith("transformer.") for name in model.state_dict())
    frozen_params = [p for m in model.frozen_modules().values() for p in m.parameters()]
    assert frozen_params and not any(p.requires_grad for p in frozen_params)
    frozen_before = frozen_state(model)
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
    frozen_after = frozen_state(model)
    assert all(torch.equal(frozen_after[k], frozen_before[k]) for k in frozen_before)
    assert all(not m.training for m in model.frozen_modules().values())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, transformer_before[k])]
    assert len(changed) > len(transformer_before) // 2


def check_one_driver_iteration_of_each_recipe(
    family: str, proxy_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The proxy recipe ``{family}_flow_grpo_proxy``, and the real one ``{family}_flow_grpo`` (its
    BF16 precision with FP32 modules named on the family's transformer) pointed at the proxy's
    directory, one iteration each through the driver, each printing its evidence level."""
    from miles_diffusion.train import main

    main([f"{family}_flow_grpo_proxy", "--iterations", "1", "--out", str(tmp_path / "proxy")])
    assert f"recipe {family}_flow_grpo_proxy: evidence level proxy gated" in capsys.readouterr().out
    main(
        [
            f"{family}_flow_grpo",
            "--model",
            str(proxy_dir),
            "--iterations",
            "1",
            "--out",
            str(tmp_path / "real"),
        ]
    )
    assert f"recipe {family}_flow_grpo: evidence level not verified" in capsys.readouterr().out
    (line,) = (tmp_path / "real" / "metrics.jsonl").read_text().splitlines()
    assert {"reward/mean", "train/loss", "eval/reward_before", "eval/reward_after"} <= set(json.loads(line))


def check_the_trainer_rescores_the_engines_batch(
    trainer: DiffusionModel, batch: TrajectoryBatch, num_steps: int
) -> None:
    """The trainer's model re-scores every one of the engine's ``num_steps`` steps (noise level 0.7)
    bit for bit and decodes the same images from the final latents."""
    trajectory = batch.trajectory
    with torch.no_grad():
        for step in range(num_steps):
            rescored = step_log_prob(trainer, trajectory, step, 0.7)[0]
            assert torch.equal(rescored, trajectory.log_probs[:, step]), step
        assert torch.equal(trainer.to_images(trajectory.latents[:, -1]), batch.images)
    assert batch.sampler == SamplerConfig(num_steps, 0.7)


def check_the_engine_loads_a_trainers_export(
    engine: DiffusionEngine, trainer: DiffusionModel, proxy: Path, dest: Path
) -> None:
    """The fleet's catch-up of a restarted engine: ``/update_weights_from_disk`` of the trainer's
    export (a whole pipeline directory, its weights moved first) loads its transformer at the given
    version, equal to the trainer's bit for bit."""
    from miles_diffusion.engine.server import UpdateFromDiskBody
    from miles_diffusion.sd3 import export_pipeline

    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.add_(0.01)
    export = export_pipeline(trainer, proxy, dest)
    answer = engine.update_from_disk(UpdateFromDiskBody(model_path=str(export), weight_version="7"))
    assert answer["success"] and engine.weight_version == 7
    engine_state, trained = engine.model.state_dict(), trainer.state_dict()
    assert set(engine_state) == set(trained) and all(
        torch.equal(engine_state[k], trained[k]) for k in trained
    )
