"""Flow-GRPO on the tiny diffusion recipe, on CPU: reward curve, step time, sampler throughput.

    uv run python benchmarks/diffusion_flow_grpo.py [--iterations 25] [--batch 16] [--repeats 5]

1. Trains the shipped ``tiny_flow_grpo`` recipe (deterministic mode, torch on one thread) and
   reports the evaluation reward before and after (fixed prompts, fixed seed), the per-iteration
   mean rollout reward, and the median seconds per iteration (rollout + reward + train), the first
   iteration not counted. The curve goes to ``docs/img/diffusion_flow_grpo.png``.
2. Sampler throughput on the same (untrained) model and batch: the Flow-GRPO SDE sampler, which
   records every latent and a log-probability per step, against a plain diffusers-style loop
   (``FlowMatchEulerDiscreteScheduler.step`` on the model's velocity, final image only). Both run
   ``num_steps`` denoising steps under ``torch.no_grad``; images per second are the median over
   ``--repeats`` timed runs after one warm-up.

Results go to ``benchmarks/results/diffusion_flow_grpo.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _bench import REPO, RESULTS_DIR, machine_info, write_result
from diffusers import FlowMatchEulerDiscreteScheduler

from miles_diffusion.model import FlowModel, build_tiny_model
from miles_diffusion.recipe import DiffusionRecipe, load_recipe
from miles_diffusion.sampler import sample
from miles_diffusion.train import TIMING_PREFIX, run


@torch.no_grad()
def plain_diffusers_loop(
    model: FlowModel, prompts: torch.Tensor, num_steps: int, generator: torch.Generator
) -> torch.Tensor:
    """Deterministic Euler sampling the way a diffusers pipeline drives a flow-matching scheduler."""
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    scheduler.set_timesteps(num_steps)
    mc = model.config
    x = torch.randn((prompts.shape[0], mc.channels, mc.image_size, mc.image_size), generator=generator)
    for timestep in scheduler.timesteps:
        t = (timestep / 1000.0).expand(prompts.shape[0])
        v = model(x, t, prompts)
        x = scheduler.step(v, timestep, x, return_dict=False)[0]
    return x


def images_per_second(fn: Any, batch: int, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return batch / statistics.median(times)


def plot(history: list[dict[str, float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    xs = [m["iteration"] for m in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, [m["reward/mean"] for m in history], marker="o", ms=3, label="rollout reward (mean)")
    ax.axhline(history[0]["eval/reward_before"], color="grey", ls="--", label="eval before")
    ax.axhline(history[-1]["eval/reward_after"], color="green", ls="--", label="eval after")
    ax.set_xlabel("iteration")
    ax.set_ylabel("brightness reward")
    ax.set_title("Flow-GRPO, tiny flow-matching UNet, CPU")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe: DiffusionRecipe = load_recipe("tiny_flow_grpo")
    if args.iterations is not None:
        recipe = replace(recipe, num_iterations=args.iterations)

    history = run(recipe)
    step_times = [m[f"{TIMING_PREFIX}step_s"] for m in history[1:]]
    rollout_times = [m[f"{TIMING_PREFIX}rollout_s"] for m in history[1:]]
    png = REPO / "docs" / "img" / "diffusion_flow_grpo.png"
    plotted = plot(history, png)

    model = build_tiny_model(recipe.model, recipe.seed).eval()
    prompts = torch.arange(args.batch) % recipe.model.num_prompts
    steps = recipe.sampler.num_steps
    sde = images_per_second(
        lambda: sample(model, prompts, recipe.sampler, torch.Generator().manual_seed(0)),
        args.batch,
        args.repeats,
    )
    plain = images_per_second(
        lambda: plain_diffusers_loop(model, prompts, steps, torch.Generator().manual_seed(0)),
        args.batch,
        args.repeats,
    )
    result = {
        "machine": {**machine_info(), "note": "CPU, 2 cores, shared with other engineers"},
        "recipe": recipe.name,
        "iterations": recipe.num_iterations,
        "images_per_iteration": recipe.prompts_per_iteration * recipe.group_size,
        "eval_reward_before": history[0]["eval/reward_before"],
        "eval_reward_after": history[-1]["eval/reward_after"],
        "rollout_reward_curve": [m["reward/mean"] for m in history],
        "median_step_s": statistics.median(step_times),
        "median_rollout_s": statistics.median(rollout_times),
        "sampler": {
            "batch": args.batch,
            "num_steps": steps,
            "flow_grpo_sde_images_per_s": sde,
            "plain_diffusers_loop_images_per_s": plain,
            "ratio": sde / plain,
        },
        "png": str(png.relative_to(REPO)) if plotted else None,
    }
    out = write_result(RESULTS_DIR / "diffusion_flow_grpo.json", result)
    print(
        f"eval reward {result['eval_reward_before']:.4f} -> {result['eval_reward_after']:.4f}; "
        f"median step {result['median_step_s']:.3f} s; sampler {sde:.1f} img/s (SDE + log-probs) "
        f"vs {plain:.1f} img/s (plain loop); wrote {out}"
    )


if __name__ == "__main__":
    main()
