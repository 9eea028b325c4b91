"""``miles run <family>_flow_grpo_proxy`` through the core CLI, one case per pipeline family served
the same way (Wan 2.x text-to-video, Qwen-Image, LTX-Video, Cosmos-Predict2; SD3 has its own file, ``test_core_sd3.py``, for what
only it checks: microgroups, streamed frames; the real-directory recipes of all five are checked in
``test_real_recipes.py``).

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

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from miles_diffusion.engine.server import DiffusionEngine, GenerateBody
from miles_diffusion.families import load_model
from miles_diffusion.payload import split
from miles_diffusion.pipeline_model import PipelineFlowModel
from miles_diffusion.train import resolve_model_dir
from miles_diffusion.wire import unpack

from ._cli_runs import check_resume_redoes_the_steps, run_and_check_the_proxy, whole_run
from ._family_checks import (
    check_the_engine_loads_a_trainers_export,
    check_the_trainer_rescores_the_engines_batch,
)
from ._standards import assert_matches_standard, write_standard
from .test_cosmos import PassThroughChecker

pytestmark = pytest.mark.slow

STEPS = 3
SAVE_EVERY = 2  # also the step --resume restarts from
WHOLE = 40  # each recipe's own run.num_steps


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
    check_the_trainer_rescores_the_engines_batch(trainer, batch, 3)
    check_the_engine_loads_a_trainers_export(engine, trainer, proxy, tmp_path / "export")


@pytest.mark.parametrize("family", CASES)
def test_miles_run_trains_resumes_and_exports_the_proxy(family: Family, tmp_path: Path) -> None:
    import diffusers
    from safetensors.torch import load_file

    args, run_dir, rows = run_and_check_the_proxy(
        family.recipe, tmp_path, STEPS, SAVE_EVERY, family.rewards, family.cut_standard
    )

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
    check_resume_redoes_the_steps(args, run_dir, rows, SAVE_EVERY)


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
