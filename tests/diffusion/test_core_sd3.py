"""``miles run sd3_flow_grpo_proxy`` through the core CLI: the SD3 family on the core loop.

The scaled-down random SD3 pipeline (``builtin:tiny-sd3``) served by the diffusion engine process
(prompt texts in each request, the VAE decode in the engine, decoded images on the wire beside the
latents), trained by the diffusion backend (the transformer alone: re-scored latents, transformer-only
weight updates and checkpoints), exported as a whole diffusers directory.

Standards (``tests/diffusion/standards/sd3_flow_grpo_proxy_core*.json``, the convention of
``test_core_run.py``): the whole 40-step recipe through the CLI, every registered metric bit for bit
(``-m extended``, about 75 s), and its first 3 steps, which the default run's 3-step run must equal.
Regenerate: ``uv run python -m tests.diffusion.test_core_sd3``.

Default run: an in-process engine whose every step's log-probability equals the trainer's re-scoring
bit for bit, and a 3-step ``miles run`` through the CLI (reward and loss logged, the engine at version
step + 1, the engine–trainer gap zero, each update the transformer's bytes, the export loaded by
diffusers' own ``StableDiffusion3Pipeline`` with the trained transformer), then ``--resume`` from
step 2's checkpoint redoing step 2 bit for bit.
"""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from miles.cli import cli
from miles_diffusion.engine.server import DiffusionEngine, EngineRefusal, GenerateBody, UpdateFromDiskBody
from miles_diffusion.families import load_model
from miles_diffusion.sampler import SamplerConfig, step_log_prob
from miles_diffusion.sd3 import SD3FlowModel, export_pipeline
from miles_diffusion.train import resolve_model_dir
from miles_diffusion.wire import FrameReader, unpack, unpack_frame

from ._standards import assert_matches_standard, write_standard

pytestmark = pytest.mark.slow

RECIPE = "sd3_flow_grpo_proxy"
STEPS = 3
RESUME_FROM = 2
WHOLE = 40  # the recipe's own run.num_steps
STANDARD = "sd3_flow_grpo_proxy_core"  # the whole recipe through miles run (compared with -m extended)
CUT_STANDARD = "sd3_flow_grpo_proxy_core_cut3"  # its first 3 steps (compared in the default run)
TEXTS = (
    "a photo of a red apple on a table",
    "a watercolor painting of a lighthouse at dusk",
    "a close-up of a cat sleeping in the sun",
    "an astronaut riding a horse on the moon",
)
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


def _miles(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output + (result.stderr if result.stderr_bytes is not None else "")
    return result


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_engine_serves_texts_and_images_the_trainer_rescores_exactly(tmp_path: Path) -> None:
    """The engine (in process) encodes the request's texts and decodes the final latents with the VAE;
    the trainer's model, loaded with the recipe's texts, re-scores every step of the same batch bit
    for bit and decodes the same images; the engine loads a trainer's export from disk."""
    proxy = resolve_model_dir("builtin:tiny-sd3")
    engine = DiffusionEngine(str(proxy), max_batch_size=8)
    ids = [2, 0, 2, 3]
    body = GenerateBody(
        prompts=ids,
        seeds=[11, 12, 13, 14],
        num_steps=4,
        noise_level=0.7,
        texts=[TEXTS[i] for i in ids],
    )
    engine.check_generate(body)
    batch = unpack(engine.generate(body))
    assert batch.images is not None and batch.images.shape == (4, 3, 32, 32)
    assert set(engine.model.state_dict()) == {
        f"transformer.{k}" for k in engine.model.transformer.state_dict()
    }
    trainer = load_model(proxy, prompts=TEXTS)
    assert isinstance(trainer, SD3FlowModel)
    trajectory = batch.trajectory
    with torch.no_grad():
        for step in range(4):
            rescored = step_log_prob(trainer, trajectory, step, 0.7)[0]
            assert torch.equal(rescored, trajectory.log_probs[:, step]), step
        assert torch.equal(trainer.to_images(trajectory.latents[:, -1]), batch.images)
    assert batch.sampler == SamplerConfig(4, 0.7)
    # In microgroups of 2 (the same noise per seed) the forward passes round a few ulp apart.
    halves = unpack(engine.generate(body.model_copy(update={"microgroup_size": 2})))
    assert torch.allclose(halves.trajectory.log_probs, trajectory.log_probs, atol=1e-5, rtol=0)
    # Streamed (the pipelined rollout's form): each microgroup's frame carries its own images, equal
    # to the unstreamed answer's at the same microgroup size.
    sent: list[bytes] = []
    streamed = body.model_copy(update={"microgroup_size": 2, "stream": True})
    engine.generate_frames(streamed, sent.append, threading.Event())
    reader = FrameReader(shared=False)
    frames = [unpack_frame(frame) for chunk in sent for frame in reader.feed(chunk)]
    assert [f.offset for f in frames] == [0, 2] and halves.images is not None
    for frame in frames:
        assert frame.batch.images is not None
        assert torch.equal(frame.batch.images, halves.images[frame.offset : frame.offset + 2])
    # The fleet's catch-up of a restarted engine: /update_weights_from_disk of a trainer's export (a
    # whole pipeline directory) loads its transformer at the given version.
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
    for bad, message in (
        ({"texts": None}, "prompted with text: give texts"),
        ({"texts": ["a", "b"]}, "2 texts for 4 prompts"),
        ({"texts": ["a", "b", "c", "d"]}, "prompt id 2 comes with two texts"),
    ):
        with pytest.raises(EngineRefusal, match=message):
            engine.check_generate(body.model_copy(update=bad))


def test_miles_run_trains_resumes_and_exports_the_sd3_proxy(tmp_path: Path) -> None:
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    overrides = [
        f"run.output_dir={tmp_path}",
        f"run.num_steps={STEPS}",
        f"run.save_every={RESUME_FROM}",
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
    # The policy moved: rewards and losses differ from step to step.
    assert len({r["rollout/reward_mean"] for r in rows}) == STEPS
    assert len({r["train/loss"] for r in rows}) == STEPS
    # Every registered metric equals the first 3 steps of the whole recipe's standard, bit for bit.
    assert_matches_standard(CUT_STANDARD, rows)

    # Checkpoints and updates carry the transformer alone.
    checkpoint = run_dir / "checkpoints" / f"step_{RESUME_FROM:06d}" / "trainer"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["trainer_state.pt", "transformer"]
    transformer_bytes = (checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    assert all(abs(r["weight_sync/bytes"] - transformer_bytes) < 0.1 * transformer_bytes for r in rows)

    # The export is a whole diffusers directory with the trained transformer.
    final = run_dir / "final"
    pipe = StableDiffusion3Pipeline.from_pretrained(str(final), text_encoder_3=None, tokenizer_3=None)
    trained = load_file(str(final / "transformer" / "diffusion_pytorch_model.safetensors"))
    base = load_file(
        str(resolve_model_dir("builtin:tiny-sd3") / "transformer" / "diffusion_pytorch_model.safetensors")
    )
    state = pipe.transformer.state_dict()
    assert all(torch.equal(state[k], t) for k, t in trained.items()) and set(trained) == set(state)
    assert any(not torch.equal(base[k], trained[k]) for k in base)
    vae = load_file(str(final / "vae" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(pipe.vae.state_dict()[k], t) for k, t in vae.items())

    # --resume from step 2's checkpoint redoes step 2 bit for bit.
    (run_dir / "checkpoints" / "latest").write_text(f"step_{RESUME_FROM:06d}")
    _miles(*args, "--resume")
    resumed = _rows(run_dir)
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for before, after in zip(rows[RESUME_FROM:], resumed[RESUME_FROM:], strict=True):
        assert {k: after[k] for k in REPEATED} == {k: before[k] for k in REPEATED}


def test_the_real_model_recipe_passes_the_checks_on_the_proxy_directory() -> None:
    """``sd3_flow_grpo`` (a local SD3.5 directory; not verified) as shipped but for ``model.path``:
    the core's checks, the component checks and the prompt-text checks all pass on the proxy's
    pipeline directory (nothing starts)."""
    from miles.config import load_recipe
    from miles.driver.preflight import close_components, preflight

    proxy = resolve_model_dir("builtin:tiny-sd3")
    config = load_recipe("sd3_flow_grpo", [f"model.path={proxy}"])
    assert config.evidence is not None and config.evidence.level == "not verified"
    checked = preflight(config)
    close_components(checked.components)
    assert checked.model_path == str(proxy.resolve())
    assert len(config.rollout.options["prompts"]) == 8


def whole_run(output_dir: Path) -> list[dict[str, float]]:
    """The shipped recipe as it is (40 steps, its seeds, one torch thread); only where it writes and
    the console differ, neither of which touches a number."""
    overrides = [f"run.output_dir={output_dir}", "tracking.console=false"]
    _miles("run", RECIPE, *(a for o in overrides for a in ("--set", o)))
    return _rows(output_dir / RECIPE)


@pytest.mark.extended
def test_the_whole_recipe_matches_its_standard_bit_for_bit(tmp_path: Path) -> None:
    rows = whole_run(tmp_path)
    assert [r["step"] for r in rows] == list(range(WHOLE))
    assert [r["engine/weight_version"] for r in rows] == list(range(1, WHOLE + 1))
    assert rows[-1]["rollout/reward_mean"] > rows[0]["rollout/reward_mean"] + 0.01  # 0.5506 -> 0.5724
    assert_matches_standard(STANDARD, rows)


if __name__ == "__main__":  # regenerate the standards: uv run python -m tests.diffusion.test_core_sd3
    with tempfile.TemporaryDirectory() as out:
        history = whole_run(Path(out))
    print(f"wrote {write_standard(STANDARD, history)}")
    print(f"wrote {write_standard(CUT_STANDARD, history[:STEPS])}")
