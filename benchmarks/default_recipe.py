"""The default recipe end to end, as a user runs it: `uv run miles run`, timed, and whether it learned.

    uv run python benchmarks/default_recipe.py

Runs ``uv run miles run`` (the built-in default recipe) from the repository root with its output in a
temporary directory, and reports the wall time of the whole command (start-up, model, engine and
trainer processes, every step, the final export), the median step time, and the reward curve from the
run's metrics.jsonl: ``rollout/reward_mean`` of the first and last steps, and the mean of the first three
steps against the mean of the last three.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _bench import (
    REPO,
    RESULTS_DIR,
    fmt,
    load_avg,
    machine_info,
    median,
    read_metrics,
    run_timed,
    tail,
    write_result,
)


def reward_summary(rows: list[dict[str, Any]], window: int = 3) -> dict[str, Any]:
    rewards = [r["rollout/reward_mean"] for r in rows if r.get("rollout/reward_mean") is not None]
    if not rewards:
        return {}
    return {
        "first_step_reward": rewards[0],
        "last_step_reward": rewards[-1],
        f"first_{window}_mean": statistics.fmean(rewards[:window]),
        f"last_{window}_mean": statistics.fmean(rewards[-window:]),
        "rewards": rewards,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=None, help="recipe to run instead of the default one")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra KEY=VALUE overrides")
    p.add_argument("--out", default=str(RESULTS_DIR / "default_recipe.json"))
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)

    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("`uv` is not on PATH; this benchmark times `uv run miles run` as a user types it")
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="miles-bench-default-") as tmp:
        cmd = [uv, "run", "miles", "run"]
        if args.recipe:
            cmd.append(args.recipe)
        for o in [f"run.output_dir={tmp}", *args.overrides]:
            cmd += ["--set", o]
        print(f"running: {' '.join(cmd)}", flush=True)
        timed = run_timed(cmd, cwd=REPO, timeout=args.timeout)
        metrics = sorted(Path(tmp).glob("*/metrics.jsonl"))
        rows = read_metrics(metrics[0]) if metrics else []
        shown = " ".join(["uv", *cmd[1:]]).replace(tmp, "<tmp>")

    result: dict[str, Any] = {
        "benchmark": "default_recipe",
        "machine": machine,
        "command": shown,
        "ok": timed.returncode == 0 and bool(rows),
        "wall_s": timed.seconds,
        "load_avg_at_end": load_avg(),
        "steps": len(rows),
        "median_step_s": median([r["time/step_s"] for r in rows if r.get("time/step_s") is not None]),
        "median_rollout_s": median(
            [r["time/rollout_s"] for r in rows if r.get("time/rollout_s") is not None]
        ),
        "median_train_step_s": median([r["time/train_step_s"] for r in rows if r.get("time/train_step_s")]),
        "median_weight_update_s": median(
            [r["time/weight_update_s"] for r in rows if r.get("time/weight_update_s")]
        ),
        "reward": reward_summary(rows),
    }
    if not result["ok"]:
        result["error"] = f"exit code {timed.returncode}; {len(rows)} metric rows"
        result["stderr_tail"] = tail(timed.stderr)
    out = write_result(args.out, result)

    rw = result["reward"]
    print(
        f"ok={result['ok']} wall {result['wall_s']:.1f}s for {result['steps']} steps "
        f"(median step {fmt(result['median_step_s'])}s)"
    )
    if rw:
        print(
            f"reward_mean: first step {rw['first_step_reward']:.3f}, last step {rw['last_step_reward']:.3f}; "
            f"first 3 mean {rw['first_3_mean']:.3f}, last 3 mean {rw['last_3_mean']:.3f}"
        )
    if not result["ok"]:
        print(result["error"], result["stderr_tail"], sep="\n")
    print(f"result: {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
