"""``miles run cosmos_flow_grpo_proxy`` through the core CLI: the Cosmos-Predict2 text-to-image
family's scaled-down random pipeline (``builtin:tiny-cosmos``) served by the diffusion engine (prompt
texts in each request, the VAE decode in the engine, [4, 8, 8] latents and [3, 32, 32] images on the
wire), trained by the diffusion backend (the transformer alone: re-scored latents, transformer-only
weight updates and checkpoints), exported as a whole diffusers directory that
Cosmos2TextToImagePipeline loads (given a safety checker: the pipeline refuses to be built without
one, and cosmos_guardrail is not installed here; see tests/diffusion/test_cosmos.py).

Standards (``tests/diffusion/standards/cosmos_flow_grpo_proxy_core*.json``, the convention of
``test_core_run.py``): the whole 40-step recipe through the CLI, every registered metric bit for bit
(``-m extended``), and its first 3 steps, which the default run's 3-step run must equal; then
``--resume`` from step 2's checkpoint redoes step 2 bit for bit. Regenerate them:
``uv run python -m tests.diffusion.test_core_cosmos``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from miles.cli import cli
from miles_diffusion.engine.server import DiffusionEngine, GenerateBody, UpdateFromDiskBody
from miles_diffusion.families import load_model
from miles_diffusion.payload import split
from miles_diffusion.pipeline_model import PipelineFlowModel
from miles_diffusion.sampler import SamplerConfig, step_log_prob
from miles_diffusion.sd3 import export_pipeline
from miles_diffusion.train import resolve_model_dir
from miles_diffusion.wire import unpack

from ._standards import assert_matches_standard, write_standard
from .test_cosmos import PassThroughChecker

pytestmark = pytest.mark.slow

STEPS = 3
SAVE_EVERY = 2  # also the step --resume restarts from
WHOLE = 40  # each recipe's own run.num_steps
# What a resumed step must reproduce exactly (wall-clock times and process counters aside).
REPEATED = (
    "rollout/reward_mean",
    "rollout/reward_std",
    "advantages/mean_raw",
    "train/loss",
    "train/grad_norm",
    "train/clip_fraction",
    "train/approx_kl_old",
    "train/rollout_log_prob_mean",
    "train/logprob_mismatch_max",
    "engine/weight_version",
)


RECIPE = "cosmos_flow_grpo_proxy"
BUILTIN = "builtin:tiny-cosmos"
TEXTS = (  # the recipe's rollout.options.prompts
    "a red balloon over a city skyline",
    "a bowl of ripe lemons on a wooden table",
    "a lighthouse on a rocky coast at night",
    "a watercolour of a fox in the snow",
)
LATENT = (4, 8, 8)  # [C, h, w] of the proxy's 32x32 images
IMAGE = (3, 32, 32)
STANDARD = f"{RECIPE}_core"  # the whole recipe through miles run (compared with -m extended)
CUT_STANDARD = f"{RECIPE}_core_cut3"  # its first 3 steps (compared in the default run)


def _miles(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output + (result.stderr if result.stderr_bytes is not None else "")
    return result


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_engine_serves_what_the_trainer_rescores_exactly(tmp_path: Path) -> None:
    """The engine (in process) sends [B, S + 1, *latent] latents and [B, *image] images; the payloads
    keep those shapes; the trainer's model (another batch: its texts by id) re-scores every step bit
    for bit and decodes the same images; the engine loads a trainer's export (a whole pipeline
    directory)."""
    proxy = resolve_model_dir(BUILTIN)
    engine = DiffusionEngine(str(proxy), max_batch_size=8)
    assert engine.family.name == "cosmos"
    ids = [1, 0, 1, 3]
    body = GenerateBody(
        prompts=ids, seeds=[5, 6, 7, 8], num_steps=3, noise_level=0.7, texts=[TEXTS[i] for i in ids]
    )
    engine.check_generate(body)
    batch = unpack(engine.generate(body))
    assert tuple(batch.trajectory.latents.shape) == (4, 4, *LATENT)
    assert batch.images is not None and tuple(batch.images.shape) == (4, *IMAGE)
    payloads = split(batch.trajectory, batch.seeds, batch.sampler, batch.weight_version, batch.images)
    assert all(tuple(p.latents.shape) == (4, *LATENT) and tuple(p.image.shape) == IMAGE for p in payloads)
    assert set(engine.model.state_dict()) == {
        f"transformer.{k}" for k in engine.model.transformer.state_dict()
    }

    trainer = load_model(proxy, prompts=TEXTS)
    assert isinstance(trainer, PipelineFlowModel) and type(trainer) is type(engine.model)
    trajectory = batch.trajectory
    with torch.no_grad():
        for step in range(3):
            rescored = step_log_prob(trainer, trajectory, step, 0.7)[0]
            assert torch.equal(rescored, trajectory.log_probs[:, step]), step
        assert torch.equal(trainer.to_images(trajectory.latents[:, -1]), batch.images)
    assert batch.sampler == SamplerConfig(3, 0.7)

    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.add_(0.01)
    export = export_pipeline(trainer, proxy, tmp_path / "export")
    answer = engine.update_from_disk(UpdateFromDiskBody(model_path=str(export), weight_version="7"))
    assert answer["success"] and engine.weight_version == 7
    engine_state, trained = engine.model.state_dict(), trainer.state_dict()
    assert set(engine_state) == set(trained) and all(
        torch.equal(engine_state[k], trained[k]) for k in trained
    )


def test_miles_run_trains_resumes_and_exports_the_proxy(tmp_path: Path) -> None:
    from diffusers import Cosmos2TextToImagePipeline
    from safetensors.torch import load_file

    overrides = [
        f"run.output_dir={tmp_path}",
        f"run.num_steps={STEPS}",
        f"run.save_every={SAVE_EVERY}",
        "tracking.console=false",
    ]
    args = ["run", RECIPE, *(a for o in overrides for a in ("--set", o))]
    result = _miles(*args)
    assert f"recipe {RECIPE}: evidence level proxy gated" in result.stderr
    run_dir = tmp_path / RECIPE
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["engine/weight_version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["train/trajectories"] == 16 and 0.0 < r["rollout/reward_mean"] < 1.0 for r in rows)
    # Engine (groups of 4, texts from the request) and trainer (16 at once, texts from the recipe)
    # agree exactly on the first denoising step's log-probability, before the step's update.
    assert all(r["train/logprob_mismatch_max"] == 0.0 for r in rows)
    assert len({r["rollout/reward_mean"] for r in rows}) == STEPS
    assert len({r["train/loss"] for r in rows}) == STEPS
    # Every registered metric equals the first 3 steps of the whole recipe's standard, bit for bit.
    assert_matches_standard(CUT_STANDARD, rows)

    # Checkpoints and updates carry the transformer alone.
    checkpoint = run_dir / "checkpoints" / f"step_{SAVE_EVERY:06d}" / "trainer"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["trainer_state.pt", "transformer"]
    transformer_bytes = (checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    assert all(abs(r["weight_sync/bytes"] - transformer_bytes) < 0.1 * transformer_bytes for r in rows)

    # The export is a whole diffusers directory with the trained transformer, loaded by the
    # family's own diffusers pipeline.
    final = run_dir / "final"
    pipe = Cosmos2TextToImagePipeline.from_pretrained(str(final), safety_checker=PassThroughChecker())
    trained = load_file(str(final / "transformer" / "diffusion_pytorch_model.safetensors"))
    base_dir = resolve_model_dir(BUILTIN)
    base = load_file(str(base_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    state = pipe.transformer.state_dict()
    assert set(trained) == set(state) and all(torch.equal(state[k], t) for k, t in trained.items())
    assert any(not torch.equal(base[k], trained[k]) for k in base)
    vae = load_file(str(final / "vae" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(pipe.vae.state_dict()[k], t) for k, t in vae.items())
    # The export's transformer is the last checkpoint's.
    last_dir = run_dir / "checkpoints" / f"step_{STEPS:06d}" / "trainer" / "transformer"
    last = load_file(str(last_dir / "diffusion_pytorch_model.safetensors"))
    assert set(last) == set(trained) and all(torch.equal(last[k], t) for k, t in trained.items())

    # --resume from step 2's checkpoint redoes step 2 bit for bit.
    (run_dir / "checkpoints" / "latest").write_text(f"step_{SAVE_EVERY:06d}")
    _miles(*args, "--resume")
    resumed = _rows(run_dir)
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for before, after in zip(rows[SAVE_EVERY:], resumed[SAVE_EVERY:], strict=True):
        assert {k: after[k] for k in REPEATED} == {k: before[k] for k in REPEATED}


def whole_run(recipe: str, output_dir: Path) -> list[dict[str, float]]:
    """The shipped recipe as it is (40 steps, its seeds, one torch thread); only where it writes and
    the console differ, neither of which touches a number."""
    overrides = [f"run.output_dir={output_dir}", "tracking.console=false"]
    _miles("run", recipe, *(a for o in overrides for a in ("--set", o)))
    return _rows(output_dir / recipe)


@pytest.mark.extended
def test_the_whole_recipe_matches_its_standard_bit_for_bit(tmp_path: Path) -> None:
    rows = whole_run(RECIPE, tmp_path)
    assert [r["step"] for r in rows] == list(range(WHOLE))
    assert [r["engine/weight_version"] for r in rows] == list(range(1, WHOLE + 1))
    assert_matches_standard(STANDARD, rows)


if __name__ == "__main__":  # uv run python -m tests.diffusion.test_core_cosmos
    with tempfile.TemporaryDirectory() as out:
        history = whole_run(RECIPE, Path(out))
    print(f"wrote {write_standard(STANDARD, history)}")
    print(f"wrote {write_standard(CUT_STANDARD, history[:STEPS])}")
