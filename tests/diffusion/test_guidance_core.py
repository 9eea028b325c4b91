"""Classifier-free guidance through the core path: the engine samples with the request's
``guidance_scale`` (wire metadata carries it), the trainer re-scores with the same scale bit for bit,
``miles run sd3_flow_grpo_proxy`` with ``rollout.options.guidance_scale=4.5`` trains with an
engine–trainer gap of exactly 0, and what cannot run is refused before anything starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from miles.cli import cli
from miles.config import load_recipe
from miles.driver.preflight import close_components, preflight
from miles.errors import MilesError
from miles_diffusion.engine.server import DiffusionEngine, EngineRefusal, GenerateBody
from miles_diffusion.families import load_model
from miles_diffusion.sampler import SamplerConfig, step_log_prob
from miles_diffusion.train import resolve_model_dir
from miles_diffusion.wire import unpack

TEXTS = ("a photo of a red apple on a table", "a lighthouse at dusk", "a cat", "an astronaut")
W = 4.5


def test_the_engine_guides_and_the_trainer_rescores_exactly() -> None:
    proxy = resolve_model_dir("builtin:tiny-sd3")
    engine = DiffusionEngine(str(proxy), max_batch_size=8)
    ids = [2, 0, 2, 3]
    body = GenerateBody(
        prompts=ids, seeds=[11, 12, 13, 14], num_steps=4, noise_level=0.7, texts=[TEXTS[i] for i in ids]
    )
    guided_body = body.model_copy(update={"guidance_scale": W})
    engine.check_generate(guided_body)
    guided = unpack(engine.generate(guided_body))
    assert guided.sampler == SamplerConfig(4, 0.7, W)  # the scale travels in the wire's metadata
    unguided = unpack(engine.generate(body))
    assert unguided.sampler == SamplerConfig(4, 0.7)
    assert torch.equal(guided.trajectory.latents[:, 0], unguided.trajectory.latents[:, 0])
    assert (guided.trajectory.latents[:, -1] - unguided.trajectory.latents[:, -1]).abs().max() > 1e-3
    trainer = load_model(proxy, prompts=TEXTS)
    with torch.no_grad():
        for step in range(4):
            rescored = step_log_prob(trainer, guided.trajectory, step, 0.7, W)[0]
            assert torch.equal(rescored, guided.trajectory.log_probs[:, step]), step
    for bad, message in (
        ({"guidance_scale": 0.5}, "greater than or equal to 1"),
        ({"guidance_scale": float("nan")}, "finite number"),
    ):
        with pytest.raises(ValueError, match=message):
            GenerateBody(**{**body.model_dump(), **bad})
    tiny = DiffusionEngine(str(resolve_model_dir("builtin:tiny-flow-unet")), max_batch_size=8)
    tiny_body = GenerateBody(prompts=[0, 1], seeds=[1, 2], num_steps=2, noise_level=0.7, guidance_scale=W)
    with pytest.raises(EngineRefusal, match="FlowModel has no unconditional branch"):
        tiny.check_generate(tiny_body)


@pytest.mark.parametrize(
    ("recipe", "overrides", "expected"),
    [
        (
            "tiny_flow_grpo",
            [f"rollout.options.guidance_scale={W}"],
            "tiny-flow-unet family has no unconditional",
        ),
        ("tiny_flow_grpo", ["rollout.options.guidance_scale=0.5"], "guidance_scale"),
        (
            "sd3_flow_grpo_proxy",
            [
                f"rollout.options.guidance_scale={W}",
                "algorithm.loss=diffusion_nft",
                "algorithm.loss_options={}",
            ],
            "objective 'diffusion_nft': DiffusionNFT regresses",
        ),
    ],
)
def test_guidance_that_cannot_run_is_refused_before_anything_starts(
    recipe: str, overrides: list[str], expected: str
) -> None:
    with pytest.raises(MilesError, match=re.escape(expected)):
        config = load_recipe(recipe, overrides)
        close_components(preflight(config).components)


@pytest.mark.slow
def test_miles_run_with_guidance_has_no_engine_trainer_gap(tmp_path: Path) -> None:
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.num_steps=2",
        "run.save_every=100",
        "tracking.console=false",
        f"rollout.options.guidance_scale={W}",
    ]
    args = ["run", "sd3_flow_grpo_proxy", *(a for o in overrides for a in ("--set", o))]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    path = tmp_path / "sd3_flow_grpo_proxy" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["train/logprob_mismatch_max"] == 0.0 for r in rows)
    assert all(0.0 < r["rollout/reward_mean"] < 1.0 for r in rows)
