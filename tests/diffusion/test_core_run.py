"""``miles run tiny_flow_grpo`` through the core CLI: the diffusion engine process, the core's buffer
and advantage stage, the diffusion backend and the colocated transport, end to end on the CPU.

The recipe is found by name (miles-diffusion's ``miles.recipes`` entry point), its evidence level is
printed, the metrics land in the run directory, the reward moves, every step leaves the engine at
version step + 1, every registered metric of the whole 25-step run equals the committed standard
``tests/diffusion/standards/tiny_flow_grpo_core*.json`` bit for bit (the recipe's "fully gated"
evidence; wall-clock times and ``_standards.NOT_REPEATABLE`` aside), and ``--resume`` from a
checkpoint redoes the later steps bit for bit.

Regenerate this machine's standard (only after an intended numerical change, or to gate a new
machine bit for bit; say so in the commit): ``uv run python -m tests.diffusion.test_core_run``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles.config import load_recipe
from miles.loop import train

from ._cli_runs import RESUMED_METRICS, metric_rows, miles
from ._standards import assert_matches_standard, write_standard

pytestmark = pytest.mark.slow

STANDARD = "tiny_flow_grpo_core"  # tests/diffusion/standards/tiny_flow_grpo_core*.json
STEPS = 25  # the recipe's own run.num_steps: the standard is of the whole recipe, not a proxy
RESUME_FROM = 22  # a checkpoint at step 22 (save_every) and at the end: the resume redoes 22..24


def _recipe_args(output_dir: Path) -> list[str]:
    """The shipped recipe as it is (25 steps, its seeds and one torch thread); only where it writes,
    how often it checkpoints and the console differ, none of which touches a number."""
    overrides = [f"run.output_dir={output_dir}", f"run.save_every={RESUME_FROM}", "tracking.console=false"]
    return ["run", "tiny_flow_grpo", *(a for o in overrides for a in ("--set", o))]


@dataclass(frozen=True)
class FullRun:
    args: list[str]
    run_dir: Path
    rows: list[dict[str, float]]  # read before any later test resumes the run
    stderr: str


def full_run_through_the_cli(output_dir: Path) -> FullRun:
    args = _recipe_args(output_dir)
    result = miles(*args)
    run_dir = output_dir / "tiny_flow_grpo"
    return FullRun(args, run_dir, metric_rows(run_dir), result.stderr)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> FullRun:
    return full_run_through_the_cli(tmp_path_factory.mktemp("core_run"))


def test_miles_run_trains_the_diffusion_recipe(full_run: FullRun) -> None:
    assert "recipe tiny_flow_grpo: evidence level fully gated" in full_run.stderr
    rows = full_run.rows
    assert [r["step"] for r in rows] == list(range(STEPS))
    # Every step updated the engine: it serves version step + 1 (the fleet checked it).
    assert [r["engine/weight_version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["train/trajectories"] == 16 and r["rollout/groups_kept"] == 4 for r in rows)
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert rewards[-1] > rewards[0] + 0.1  # brightness rises (docs/diffusion.md: 0.541 -> 0.803)
    assert (full_run.run_dir / "final" / "model.safetensors").is_file()  # the policy, loadable as model.path


def test_every_metric_matches_the_committed_standard_bit_for_bit(full_run: FullRun) -> None:
    assert_matches_standard(STANDARD, full_run.rows)


def test_resume_redoes_the_last_steps_exactly(full_run: FullRun) -> None:
    # The run stopped after step 22's checkpoint (the latest pointer names it): --resume redoes 22..24.
    (full_run.run_dir / "checkpoints" / "latest").write_text(f"step_{RESUME_FROM:06d}")
    miles(*full_run.args, "--resume")
    resumed = metric_rows(full_run.run_dir)
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for before, after in zip(full_run.rows[RESUME_FROM:], resumed[RESUME_FROM:], strict=True):
        assert {k: after[k] for k in RESUMED_METRICS} == {k: before[k] for k in RESUMED_METRICS}


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
    rows = metric_rows(Path(result.run_dir))
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
    miles("run", "tiny_flow_grpo", *(a for o in overrides for a in ("--set", o)))
    rows = metric_rows(tmp_path / "tiny_flow_grpo")
    assert [r["engine/weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["train/trajectories"] == 16 and r["rollout/groups_kept"] == 4 for r in rows)
    assert all(0.0 < r["rollout/reward_mean"] < 1.0 for r in rows)


if __name__ == "__main__":  # regenerate the standard: uv run python -m tests.diffusion.test_core_run
    with tempfile.TemporaryDirectory() as out:
        print(f"wrote {write_standard(STANDARD, full_run_through_the_cli(Path(out)).rows)}")
