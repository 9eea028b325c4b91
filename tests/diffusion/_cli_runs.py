"""What the ``miles run`` tests of the diffusion recipes share: the CLI called in process, a run's
metric rows, the metrics a resumed step must repeat, and the checks every pipeline family's proxy
run makes alike (SD3's in ``test_core_sd3.py``, the others' in ``test_core_families.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from miles.cli import cli

from ._standards import assert_matches_standard

RESUMED_METRICS = (
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
"""What a resumed step must reproduce exactly (wall-clock times and process counters aside; the
buffer's running totals start again in a resumed process)."""

PIPELINE_RESUMED_METRICS = (*RESUMED_METRICS, "train/logprob_mismatch_max")
"""What a resumed step of a pipeline family's recipe must reproduce exactly: the engine-trainer gap
too (zero on every step)."""

LORA_RESUMED_METRICS = (
    "rollout/reward_mean",
    "rollout/reward_std",
    "train/loss",
    "train/grad_norm",
    "train/clip_fraction",
    "train/rollout_log_prob_mean",
    "train/logprob_mismatch_max",
    "weight_sync/bytes",
    "engine/weight_version",
)
"""What a resumed step of a LoRA recipe must reproduce exactly: its update's bytes too (the adapter)."""


def miles(*args: str) -> Result:
    """``miles *args`` in process; fails the test with the CLI's output if it exits non-zero."""
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output + (result.stderr if result.stderr_bytes is not None else "")
    return result


def metric_rows(run_dir: Path) -> list[dict[str, float]]:
    """A run's ``metrics.jsonl``, one dict a step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def whole_run(recipe: str, output_dir: Path) -> list[dict[str, float]]:
    """The shipped recipe as it is (40 steps, its seeds, one torch thread); only where it writes and
    the console differ, neither of which touches a number."""
    overrides = [f"run.output_dir={output_dir}", "tracking.console=false"]
    miles("run", recipe, *(a for o in overrides for a in ("--set", o)))
    return metric_rows(output_dir / recipe)


def check_the_proxy_steps(rows: list[dict[str, float]], steps: int, rewards: tuple[float, float]) -> None:
    """Every step trains 16 trajectories with the engine one version ahead, its reward mean within
    ``rewards``; engine (groups of 4, texts from the request) and trainer (16 at once, texts from the
    recipe) agree exactly on the first denoising step's log-probability, before the step's update;
    the policy moves (rewards and losses differ from step to step)."""
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["engine/weight_version"] for r in rows] == list(range(1, steps + 1))
    low, high = rewards
    assert all(r["train/trajectories"] == 16 and low < r["rollout/reward_mean"] < high for r in rows)
    assert all(r["train/logprob_mismatch_max"] == 0.0 for r in rows)
    assert len({r["rollout/reward_mean"] for r in rows}) == steps
    assert len({r["train/loss"] for r in rows}) == steps


def check_updates_carry_the_transformer_alone(run_dir: Path, step: int, rows: list[dict[str, float]]) -> None:
    """Step ``step``'s checkpoint holds the trainer state and the transformer alone, and every weight
    update is about the transformer's bytes."""
    checkpoint = run_dir / "checkpoints" / f"step_{step:06d}" / "trainer"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["trainer_state.pt", "transformer"]
    transformer_bytes = (checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    assert all(abs(r["weight_sync/bytes"] - transformer_bytes) < 0.1 * transformer_bytes for r in rows)


def run_and_check_the_proxy(
    recipe: str,
    output_dir: Path,
    steps: int,
    save_every: int,
    rewards: tuple[float, float],
    cut_standard: str,
) -> tuple[list[str], Path, list[dict[str, float]]]:
    """``miles run <recipe>`` (a pipeline family's proxy recipe) for ``steps`` steps, a checkpoint
    every ``save_every``, checked as every family's is (:func:`check_the_proxy_steps`, the first
    steps of the whole recipe's standard ``cut_standard`` bit for bit, and
    :func:`check_updates_carry_the_transformer_alone`). Returns the CLI arguments (to resume with),
    the run directory and its rows."""
    overrides = [
        f"run.output_dir={output_dir}",
        f"run.num_steps={steps}",
        f"run.save_every={save_every}",
        "tracking.console=false",
    ]
    args = ["run", recipe, *(a for o in overrides for a in ("--set", o))]
    result = miles(*args)
    assert f"recipe {recipe}: evidence level proxy gated" in result.stderr
    run_dir = output_dir / recipe
    rows = metric_rows(run_dir)
    check_the_proxy_steps(rows, steps, rewards)
    # Every registered metric equals the first steps of the whole recipe's standard, bit for bit.
    assert_matches_standard(cut_standard, rows)
    check_updates_carry_the_transformer_alone(run_dir, save_every, rows)
    return args, run_dir, rows


def check_resume_redoes_the_steps(
    args: list[str], run_dir: Path, rows: list[dict[str, float]], resume_from: int
) -> None:
    """``--resume`` from step ``resume_from``'s checkpoint redoes the steps from it bit for bit."""
    (run_dir / "checkpoints" / "latest").write_text(f"step_{resume_from:06d}")
    miles(*args, "--resume")
    resumed = metric_rows(run_dir)
    assert [r["step"] for r in resumed] == [r["step"] for r in rows]
    for before, after in zip(rows[resume_from:], resumed[resume_from:], strict=True):
        assert {k: after[k] for k in PIPELINE_RESUMED_METRICS} == {
            k: before[k] for k in PIPELINE_RESUMED_METRICS
        }
