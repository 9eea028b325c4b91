"""``miles run tiny_flow_grpo`` through the core CLI: the diffusion engine process, the core's buffer
and advantage stage, the diffusion backend and the colocated transport, end to end on the CPU.

The recipe is found by name (miles-diffusion's ``miles.recipes`` entry point), its evidence level is
printed, the metrics land in the run directory, the reward moves, every step leaves the engine at
version step + 1, and ``--resume`` from a checkpoint redoes the later steps bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles.cli import cli
from miles.config import load_recipe
from miles.loop import train

pytestmark = pytest.mark.slow

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
    "engine/weight_version",
)


def _miles(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output + (result.stderr if result.stderr_bytes is not None else "")
    return result


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_miles_run_trains_the_diffusion_recipe_and_resumes_exactly(tmp_path: Path) -> None:
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.num_steps=5",
        "run.save_every=3",
        "tracking.console=false",
        "engine.options.torch_threads=1",
        "diffusion.torch_threads=1",
    ]
    args = ["run", "tiny_flow_grpo", *(a for o in overrides for a in ("--set", o))]
    first = _miles(*args)
    assert "recipe tiny_flow_grpo: evidence level verified" in first.stderr
    run_dir = tmp_path / "tiny_flow_grpo"
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # Every step updated the engine: it serves version step + 1 (the fleet checked it).
    assert [r["engine/weight_version"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["train/trajectories"] == 16 and r["rollout/groups_kept"] == 4 for r in rows)
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert rewards[-1] > rewards[0]  # brightness rises from the first steps (docs/diffusion.md: 25 steps)
    assert (run_dir / "final" / "model.safetensors").is_file()  # the policy, loadable as model.path

    # The run stopped after step 3's checkpoint (the latest pointer names it): --resume redoes 3 and 4.
    (run_dir / "checkpoints" / "latest").write_text("step_000003")
    _miles(*args, "--resume")
    resumed = _rows(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for before, after in zip(rows[3:], resumed[3:], strict=True):
        assert {k: after[k] for k in REPEATED} == {k: before[k] for k in REPEATED}


def test_the_diffusion_nft_recipe_runs_through_the_core_loop(tmp_path: Path) -> None:
    config = load_recipe(
        "tiny_diffusion_nft",
        [
            f"run.output_dir={tmp_path}",
            "run.num_steps=2",
            "run.save_every=null",
            "run.export_hf=false",
            "tracking.console=false",
            "engine.options.torch_threads=1",
        ],
    )
    result = train(config)
    rows = _rows(Path(result.run_dir))
    assert [r["engine/weight_version"] for r in rows] == [1, 2]
    assert all(0.0 <= r["train/optimality/mean"] <= 1.0 and r["train/positive_loss"] > 0 for r in rows)


def test_miles_run_with_the_pipelined_rollout(tmp_path: Path) -> None:
    """Microgroups of 2 streamed and scored as they arrive, through the whole core loop."""
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.num_steps=3",
        "run.save_every=null",
        "run.export_hf=false",
        "tracking.console=false",
        "engine.options.torch_threads=1",
        "diffusion.torch_threads=1",
        "rollout.options.pipeline=true",
        "rollout.options.microgroup_size=2",
        "rollout.options.decode_workers=1",
    ]
    _miles("run", "tiny_flow_grpo", *(a for o in overrides for a in ("--set", o)))
    rows = _rows(tmp_path / "tiny_flow_grpo")
    assert [r["engine/weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["train/trajectories"] == 16 and r["rollout/groups_kept"] == 4 for r in rows)
    assert all(0.0 < r["rollout/reward_mean"] < 1.0 for r in rows)
