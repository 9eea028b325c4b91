"""Start-up cost of a tiny `miles run`, with the installed packages' bytecode and without it.

A one-step run of the default recipe's RL stage (no warm start, no evaluation, no export) spends
well under a second in its step; the rest of its wall time is start-up: the run process, the engine
process and the trainer rank each import torch and transformers. Where ``PYTHONDONTWRITEBYTECODE``
is set (CI images often set it) and the environment was installed without bytecode, every one of
those processes compiles those libraries' sources again. "without" points ``PYTHONPYCACHEPREFIX``
at an empty directory (inherited by the child processes), which is exactly that situation, without
touching the environment. The two are alternated so that machine noise falls on both.

    uv run python benchmarks/startup_time.py --repeats 3 --out benchmarks/results/startup_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

OVERRIDES = [
    "warm_start=null",
    "eval=null",
    "rollout.reward=numeric_closeness",
    "run.num_steps=1",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "run.export_hf=false",
    "tracking.console=false",
]


def one_run(bytecode: bool) -> float:
    out = tempfile.mkdtemp(prefix="miles-startup-")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    empty = None
    if not bytecode:
        empty = tempfile.mkdtemp(prefix="miles-nopyc-")
        env["PYTHONPYCACHEPREFIX"] = empty
    cmd = [sys.executable, "-m", "miles", "run", "default", "--set", f"run.output_dir={out}"]
    for o in OVERRIDES:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    if empty:
        shutil.rmtree(empty, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"miles run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"bytecode": [], "no_bytecode": []}
    for i in range(args.repeats):
        for name, bytecode in (("bytecode", True), ("no_bytecode", False)):
            wall = one_run(bytecode)
            times[name].append(wall)
            print(f"repeat {i}: {name:12s} {wall:6.1f} s", flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "seconds": times,
        "median_s": medians,
        "ratio_no_bytecode_over_bytecode": medians["no_bytecode"] / medians["bytecode"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
