"""``miles run <family>_flow_grpo_proxy`` through the core CLI, one case per pipeline family served
the same way (Wan 2.x text-to-video, Qwen-Image, LTX-Video, Cosmos-Predict2; SD3 has its own file, ``test_core_sd3.py``, for what
only it checks: microgroups, streamed frames, the real-model recipe).

Each family's scaled-down random pipeline (``builtin:tiny-<family>``) is served by the diffusion
engine (prompt texts in each request, the VAE decode in the engine, latents and images on the wire
with their real shapes: video latents ``[C, F, h, w]`` and filmstrips ``[3, H, frames * W]`` for
Wan), trained by the diffusion backend (the transformer alone: re-scored latents, transformer-only
weight updates and checkpoints), exported as a whole diffusers directory the family's own diffusers
pipeline loads.

Standards (``tests/diffusion/standards/<recipe>_core*.json``, the convention of ``test_core_run.py``):
the whole 40-step recipe through the CLI, every registered metric bit for bit (``-m extended``), and
its first 3 steps, which the default run's 3-step run must equal; then ``--resume`` from step 2's
checkpoint redoes step 2 bit for bit. Regenerate one family's:
``uv run python -m tests.diffusion.test_core_families <recipe>``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Family:
    recipe: str
    builtin: str
    name: str  # the family's registered name
    pipeline: str  # the diffusers pipeline class that loads the export
    texts: tuple[str, ...]  # the recipe's rollout.options.prompts
    latent: tuple[int, ...]  # one trajectory step's latents
    image: tuple[int, ...]  # one decoded image
    rewards: tuple[float, float] = (0.0, 1.0)  # where the recipe's reward means lie (brightness)
    needs_safety_checker: bool = False  # the pipeline refuses to be built without one (Cosmos)

    @property
    def standard(self) -> str:  # the whole recipe through miles run (compared with -m extended)
        return f"{self.recipe}_core"

    @property
    def cut_standard(self) -> str:  # its first 3 steps (compared in the default run)
        return f"{self.recipe}_core_cut3"


FAMILIES = {
    f.recipe: f
    for f in (
        Family(
            "wan_flow_grpo_proxy",
            "builtin:tiny-wan",
            "wan",
            "WanPipeline",
            (
                "a red balloon drifting over a city",
                "waves rolling onto a beach at sunset",
                "a cat chasing a ball of yarn",
                "a timelapse of clouds over mountains",
            ),
            latent=(4, 3, 4, 4),  # [C, F, h, w] of the proxy's 5-frame 16x16 videos
            image=(3, 16, 5 * 16),  # each video's 5 frames side by side
        ),
        Family(
            "qwen_image_flow_grpo_proxy",
            "builtin:tiny-qwen-image",
            "qwen-image",
            "QwenImagePipeline",
            (
                "a red balloon over a city skyline",
                "a bowl of ripe lemons on a wooden table",
                "a lighthouse on a rocky coast at night",
                "a watercolour of a fox in the snow",
            ),
            latent=(4, 8, 8),  # [C, h, w] of the proxy's 32x32 images
            image=(3, 32, 32),
        ),
        Family(
            "ltx_flow_grpo_proxy",
            "builtin:tiny-ltx",
            "ltx",
            "LTXPipeline",
            (
                "a red balloon drifting over a city",
                "waves rolling onto a beach at sunset",
                "a cat chasing a ball of yarn",
                "a timelapse of clouds over mountains",
            ),
            latent=(8, 3, 4, 4),  # [C, F, h, w] of the proxy's 5 frames of 32x32
            image=(3, 32, 5 * 32),  # the frames side by side
            rewards=(-6.0, -4.0),  # JPEG compressibility: minus kilobytes per image
        ),
        Family(
            "cosmos_flow_grpo_proxy",
            "builtin:tiny-cosmos",
            "cosmos",
            "Cosmos2TextToImagePipeline",
            (
                "a red balloon over a city skyline",
                "a bowl of ripe lemons on a wooden table",
                "a lighthouse on a rocky coast at night",
                "a watercolour of a fox in the snow",
            ),
            latent=(4, 8, 8),  # [C, h, w] of the proxy's 32x32 images
            image=(3, 32, 32),
            # cosmos_guardrail is not installed here: test_cosmos.py's pass-through stand-in
            needs_safety_checker=True,
        ),
    )
}
CASES = [pytest.param(f, id=f.name) for f in FAMILIES.values()]


def _miles(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output + (result.stderr if result.stderr_bytes is not None else "")
    return result


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", CASES)
def test_the_engine_serves_what_the_trainer_rescores_exactly(family: Family, tmp_path: Path) -> None:
    """The engine (in process) sends [B, S + 1, *latent] latents and [B, *image] images; the payloads
    keep those shapes; the trainer's model (another batch: its texts by id) re-scores every step bit
    for bit and decodes the same images; the engine loads a trainer's export (a whole pipeline
    directory)."""
    proxy = resolve_model_dir(family.builtin)
    engine = DiffusionEngine(str(proxy), max_batch_size=8)
    assert engine.family.name == family.name
    ids = [1, 0, 1, 3]
    body = GenerateBody(
        prompts=ids, seeds=[5, 6, 7, 8], num_steps=3, noise_level=0.7, texts=[family.texts[i] for i in ids]
    )
    engine.check_generate(body)
    batch = unpack(engine.generate(body))
    assert tuple(batch.trajectory.latents.shape) == (4, 4, *family.latent)
    assert batch.images is not None and tuple(batch.images.shape) == (4, *family.image)
    payloads = split(batch.trajectory, batch.seeds, batch.sampler, batch.weight_version, batch.images)
    assert all(
        tuple(p.latents.shape) == (4, *family.latent) and tuple(p.image.shape) == family.image
        for p in payloads
    )
    assert set(engine.model.state_dict()) == {
        f"transformer.{k}" for k in engine.model.transformer.state_dict()
    }

    trainer = load_model(proxy, prompts=family.texts)
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


@pytest.mark.parametrize("family", CASES)
def test_miles_run_trains_resumes_and_exports_the_proxy(family: Family, tmp_path: Path) -> None:
    import diffusers
    from safetensors.torch import load_file

    overrides = [
        f"run.output_dir={tmp_path}",
        f"run.num_steps={STEPS}",
        f"run.save_every={SAVE_EVERY}",
        "tracking.console=false",
    ]
    args = ["run", family.recipe, *(a for o in overrides for a in ("--set", o))]
    result = _miles(*args)
    assert f"recipe {family.recipe}: evidence level proxy gated" in result.stderr
    run_dir = tmp_path / family.recipe
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["engine/weight_version"] for r in rows] == list(range(1, STEPS + 1))
    low, high = family.rewards
    assert all(r["train/trajectories"] == 16 and low < r["rollout/reward_mean"] < high for r in rows)
    # Engine (groups of 4, texts from the request) and trainer (16 at once, texts from the recipe)
    # agree exactly on the first denoising step's log-probability, before the step's update.
    assert all(r["train/logprob_mismatch_max"] == 0.0 for r in rows)
    assert len({r["rollout/reward_mean"] for r in rows}) == STEPS
    assert len({r["train/loss"] for r in rows}) == STEPS
    # Every registered metric equals the first 3 steps of the whole recipe's standard, bit for bit.
    assert_matches_standard(family.cut_standard, rows)

    # Checkpoints and updates carry the transformer alone.
    checkpoint = run_dir / "checkpoints" / f"step_{SAVE_EVERY:06d}" / "trainer"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["trainer_state.pt", "transformer"]
    transformer_bytes = (checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    assert all(abs(r["weight_sync/bytes"] - transformer_bytes) < 0.1 * transformer_bytes for r in rows)

    # The export is a whole diffusers directory with the trained transformer, loaded by the
    # family's own diffusers pipeline.
    final = run_dir / "final"
    extra = {"safety_checker": PassThroughChecker()} if family.needs_safety_checker else {}
    pipe = getattr(diffusers, family.pipeline).from_pretrained(str(final), **extra)
    trained = load_file(str(final / "transformer" / "diffusion_pytorch_model.safetensors"))
    base_dir = resolve_model_dir(family.builtin)
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
@pytest.mark.parametrize("family", CASES)
def test_the_whole_recipe_matches_its_standard_bit_for_bit(family: Family, tmp_path: Path) -> None:
    rows = whole_run(family.recipe, tmp_path)
    assert [r["step"] for r in rows] == list(range(WHOLE))
    assert [r["engine/weight_version"] for r in rows] == list(range(1, WHOLE + 1))
    assert_matches_standard(family.standard, rows)


if __name__ == "__main__":  # uv run python -m tests.diffusion.test_core_families <recipe>
    chosen = FAMILIES[sys.argv[1]]
    with tempfile.TemporaryDirectory() as out:
        history = whole_run(chosen.recipe, Path(out))
    print(f"wrote {write_standard(chosen.standard, history)}")
    print(f"wrote {write_standard(chosen.cut_standard, history[:STEPS])}")
