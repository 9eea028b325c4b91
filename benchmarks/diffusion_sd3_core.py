"""Flow-GRPO on the scaled-down Stable Diffusion 3 proxy through the core loop (``miles run``), on CPU.

    uv run python benchmarks/diffusion_sd3_core.py [--steps 40]

Runs the shipped ``sd3_flow_grpo_proxy`` run recipe through the CLI (the diffusion engine process
serving ``builtin:tiny-sd3``: prompt texts per request, VAE decode in the engine; the diffusion
backend training the transformer; the colocated hand-off of the transformer's weights), then reports
the rollout reward at every step, the engine-trainer gap (``train/logprob_mismatch_max``), the bytes
of each weight update and the median step time (the first step not counted). The curve goes to
``docs/img/diffusion_sd3_core.png``; results to ``benchmarks/results/diffusion_sd3_core.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import REPO, RESULTS_DIR, load_avg, machine_info, write_result


def plot(rows: list[dict[str, float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        [r["step"] for r in rows],
        [r["rollout/reward_mean"] for r in rows],
        marker="o",
        ms=3,
        label="rollout reward (mean of 16)",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("brightness of the decoded images")
    ax.set_title("miles run sd3_flow_grpo_proxy (tiny-sd3), CPU")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=None, help="run.num_steps (default: the recipe's 40)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "miles",
            "run",
            "sd3_flow_grpo_proxy",
            "--set",
            f"run.output_dir={out}",
            "--set",
            "tracking.console=false",
            "--set",
            "run.export_hf=false",
        ]
        if args.steps is not None:
            command += ["--set", f"run.num_steps={args.steps}"]
        started = time.perf_counter()
        subprocess.run(command, check=True, cwd=REPO)
        wall = time.perf_counter() - started
        rows = [
            json.loads(line)
            for line in (Path(out) / "sd3_flow_grpo_proxy" / "metrics.jsonl").read_text().splitlines()
        ]
    rewards = [r["rollout/reward_mean"] for r in rows]
    result = {
        "steps": len(rows),
        "rollout_reward": rewards,
        "logprob_mismatch_max": max(r["train/logprob_mismatch_max"] for r in rows),
        "weight_sync_bytes": sorted({r["weight_sync/bytes"] for r in rows}),
        "engine_versions_ok": [r["engine/weight_version"] for r in rows] == list(range(1, len(rows) + 1)),
        "median_step_s": statistics.median(r["time/step_s"] for r in rows[1:]),
        "median_rollout_s": statistics.median(r["time/rollout_s"] for r in rows[1:]),
        "median_train_s": statistics.median(r["time/train_step_s"] for r in rows[1:]),
        "median_weight_update_s": statistics.median(r["time/weight_update_s"] for r in rows[1:]),
        "command_wall_s": wall,
        "load_avg_at_end": load_avg(),
        "machine": machine_info(),
    }
    result["curve"] = plot(rows, REPO / "docs" / "img" / "diffusion_sd3_core.png")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    write_result(RESULTS_DIR / "diffusion_sd3_core.json", result)


if __name__ == "__main__":
    main()
