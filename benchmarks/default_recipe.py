"""Does the README's `uv run miles run` learn, and how long does it take? (issue 13, item 7)

Runs the built-in default recipe through the real CLI (`miles run --overwrite`, in a temporary
output directory), times it end to end, and measures the greedy exact-answer rate over all 55
prompts of the policy at three points: the random initialisation, the end of the warm start
(`warm_start/final`), and the end of RL (`final`). With `--no-warm-start` it also runs the recipe
without its supervised stage (RL from random weights, as the default was before), for comparison.

    uv run python benchmarks/default_recipe.py [--no-warm-start] [--out benchmarks/results/default_recipe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


def _run(out_dir: str, *overrides: str) -> float:
    argv = [sys.executable, "-m", "miles", "run", "--overwrite", "--set", f"run.output_dir={out_dir}"]
    for o in ("tracking.console=false", *overrides):
        argv += ["--set", o]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _eval_rates(run_dir: str) -> list[tuple[int, float]]:
    with open(os.path.join(run_dir, "eval.jsonl"), encoding="utf-8") as f:
        return [(r["step"], r["metrics"]["pass_rate"]) for r in map(json.loads, f)]


def main() -> None:
    from miles.eval.greedy import greedy_exact_rate
    from miles.models.registry import resolve_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-warm-start", action="store_true", help="also run RL from random weights")
    parser.add_argument("--out", default="benchmarks/results/default_recipe.json")
    args = parser.parse_args()

    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
        "initial_exact": greedy_exact_rate(resolve_model("builtin:tiny-qwen3")).rate,
    }
    with tempfile.TemporaryDirectory() as tmp:
        result["wall_s"] = _run(tmp)
        run_dir = os.path.join(tmp, "default")
        result["warm_start_exact"] = greedy_exact_rate(os.path.join(run_dir, "warm_start", "final")).rate
        result["final_exact"] = greedy_exact_rate(os.path.join(run_dir, "final")).rate
        result["eval_pass_rate"] = _eval_rates(run_dir)
        if args.no_warm_start:
            result["rl_only_wall_s"] = _run(tmp, "warm_start=null", "run.name=rl-only")
            result["rl_only_final_exact"] = greedy_exact_rate(os.path.join(tmp, "rl-only", "final")).rate
            result["rl_only_eval_pass_rate"] = _eval_rates(os.path.join(tmp, "rl-only"))
    result["load_average_at_end"] = round(os.getloadavg()[0], 1)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
