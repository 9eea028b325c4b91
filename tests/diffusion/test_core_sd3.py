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

import tempfile
import threading
from pathlib import Path

import pytest
import torch

from miles_diffusion.engine.server import DiffusionEngine, EngineRefusal, GenerateBody
from miles_diffusion.families import load_model
from miles_diffusion.sd3 import SD3FlowModel
from miles_diffusion.train import resolve_model_dir
from miles_diffusion.wire import FrameReader, unpack, unpack_frame

from ._cli_runs import check_resume_redoes_the_steps, run_and_check_the_proxy, whole_run
from ._family_checks import (
    check_the_engine_loads_a_trainers_export,
    check_the_trainer_rescores_the_engines_batch,
)
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
    check_the_trainer_rescores_the_engines_batch(trainer, batch, 4)
    trajectory = batch.trajectory
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
    check_the_engine_loads_a_trainers_export(engine, trainer, proxy, tmp_path / "export")
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

    args, run_dir, rows = run_and_check_the_proxy(
        RECIPE, tmp_path, STEPS, RESUME_FROM, (0.0, 1.0), CUT_STANDARD
    )

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
    check_resume_redoes_the_steps(args, run_dir, rows, RESUME_FROM)


@pytest.mark.extended
def test_the_whole_recipe_matches_its_standard_bit_for_bit(tmp_path: Path) -> None:
    rows = whole_run(RECIPE, tmp_path)
    assert [r["step"] for r in rows] == list(range(WHOLE))
    assert [r["engine/weight_version"] for r in rows] == list(range(1, WHOLE + 1))
    assert rows[-1]["rollout/reward_mean"] > rows[0]["rollout/reward_mean"] + 0.01  # 0.5506 -> 0.5724
    assert_matches_standard(STANDARD, rows)


if __name__ == "__main__":  # regenerate the standards: uv run python -m tests.diffusion.test_core_sd3
    with tempfile.TemporaryDirectory() as out:
        history = whole_run(RECIPE, Path(out))
    print(f"wrote {write_standard(STANDARD, history)}")
    print(f"wrote {write_standard(CUT_STANDARD, history[:STEPS])}")
