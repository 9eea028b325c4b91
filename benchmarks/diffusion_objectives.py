"""Flow-GRPO, DiffusionNFT and diffusion SFT on the tiny diffusion recipes, on CPU: curves and step time.

    uv run python benchmarks/diffusion_objectives.py [--iterations N]

1. ``tiny_flow_grpo`` and ``tiny_diffusion_nft``: the same tiny random UNet, the same rollouts
   (4 prompts x groups of 4, 8 SDE steps, brightness reward), the same optimizer settings; only the
   objective differs. Reported: the evaluation reward before and after (16 images, fixed prompts and
   seed), the rollout reward of every iteration, the median seconds per iteration (sampling + reward
   + training; iteration 0 not counted).
2. ``tiny_sft``: flow matching on the procedural coloured-shapes set. Reported: the training loss of
   every iteration, the held-out flow-matching loss before and after (fixed noise levels and noise),
   and the distance of the samples' mean colour per prompt to the training set's, before and after.

All three run in deterministic mode with torch on one thread (the package's own driver, not the
core ``miles run`` loop). ``--iterations`` overrides every recipe's length. Results go to
``benchmarks/results/diffusion_objectives.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from _bench import RESULTS_DIR, load_avg, machine_info, write_result

from miles_diffusion.recipe import load_recipe
from miles_diffusion.train import TIMING_PREFIX, run


def _train(name: str, iterations: int | None) -> tuple[list[dict[str, float]], float]:
    recipe = load_recipe(name)
    if iterations is not None:
        recipe = replace(recipe, num_iterations=iterations)
    started = time.perf_counter()
    history = run(recipe)
    return history, time.perf_counter() - started


def _summary(history: list[dict[str, float]], wall_s: float) -> dict[str, Any]:
    first, last = history[0], history[-1]
    out: dict[str, Any] = {
        "iterations": len(history),
        "wall_s": wall_s,
        "median_step_s": statistics.median(m[f"{TIMING_PREFIX}step_s"] for m in history[1:]),
        **{k: v for k, v in first.items() if k.startswith("eval/") and k.endswith("_before")},
        **{k: v for k, v in last.items() if k.startswith("eval/") and k.endswith("_after")},
        "train_loss_curve": [m["train/loss"] for m in history],
    }
    if "reward/mean" in first:
        out["rollout_reward_curve"] = [m["reward/mean"] for m in history]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "machine": {**machine_info(), "note": "CPU, 2 cores, shared with other engineers"},
        "load_avg_start": load_avg(),
    }
    for name in ("tiny_flow_grpo", "tiny_diffusion_nft", "tiny_sft"):
        history, wall_s = _train(name, args.iterations)
        result[name] = _summary(history, wall_s)
        evals = {k: round(v, 4) for k, v in result[name].items() if k.startswith("eval/")}
        print(f"{name}: {evals}; median step {result[name]['median_step_s']:.3f} s", flush=True)
    result["load_avg_end"] = load_avg()
    out = write_result(RESULTS_DIR / "diffusion_objectives.json", result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
