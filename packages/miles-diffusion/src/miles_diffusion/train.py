"""Self-contained Flow-GRPO driver: ``python -m miles_diffusion.train RECIPE --out DIR``.

Not yet the core ``miles run`` loop: it samples, scores and trains in one process with the package's
own typed pieces, and writes one JSON line of metrics per iteration to ``DIR/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from miles_diffusion.deterministic import check_attention_backends, deterministic_mode
from miles_diffusion.flow_grpo import group_advantages
from miles_diffusion.model import FlowModel, build_tiny_model
from miles_diffusion.recipe import DiffusionRecipe, load_recipe
from miles_diffusion.rewards import ImageReward, load_reward
from miles_diffusion.sampler import sample
from miles_diffusion.trainer import FlowGRPOTrainer, choose_steps

TIMING_PREFIX = "time/"
"""Metrics under this prefix are wall-clock times: registered, but not repeatable bit for bit."""


def evaluate(model: FlowModel, recipe: DiffusionRecipe, reward: ImageReward) -> float:
    """Mean reward over a fixed set of prompts and a fixed seed, so runs compare like for like."""
    prompts = torch.arange(recipe.model.num_prompts).repeat_interleave(recipe.eval_prompts_per_id)
    generator = torch.Generator().manual_seed(recipe.eval_seed)
    trajectory = sample(model, prompts, recipe.sampler, generator)
    return float(reward(trajectory.images, prompts).mean())


def run(
    recipe: DiffusionRecipe,
    out_dir: Path | None = None,
    on_metrics: Callable[[dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Train ``recipe`` for its iterations; return (and optionally write) the metrics of each.

    In deterministic mode, torch's deterministic-algorithms switch is on for the run and restored after.
    """
    mode = deterministic_mode(recipe.seed) if recipe.deterministic else contextlib.nullcontext()
    with mode:
        return _run(recipe, out_dir, on_metrics)


def _run(
    recipe: DiffusionRecipe,
    out_dir: Path | None,
    on_metrics: Callable[[dict[str, float]], None] | None,
) -> list[dict[str, float]]:
    model = build_tiny_model(recipe.model, recipe.seed)
    model.eval()
    if recipe.deterministic:
        check_attention_backends(model)
    reward = load_reward(recipe.reward.name, recipe.reward.options)
    trainer = FlowGRPOTrainer(model, recipe.objective, recipe.trainer, recipe.sampler.noise_level)
    generator = torch.Generator().manual_seed(recipe.seed)
    history: list[dict[str, float]] = []
    sink = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        sink = (out_dir / "metrics.jsonl").open("w")
    try:
        eval_before = evaluate(model, recipe, reward)
        for iteration in range(recipe.num_iterations):
            started = time.perf_counter()
            ids = torch.randint(
                recipe.model.num_prompts, (recipe.prompts_per_iteration,), generator=generator
            )
            prompts = ids.repeat_interleave(recipe.group_size)
            trajectory = sample(model, prompts, recipe.sampler, generator)
            sampled = time.perf_counter()
            rewards = reward(trajectory.images, prompts)
            advantages = group_advantages(rewards, recipe.group_size, recipe.objective.eps)
            steps = choose_steps(trajectory.num_steps, recipe.trainer.train_step_fraction, generator)
            stats = trainer.train_step(trajectory, advantages, steps)
            finished = time.perf_counter()
            metrics: dict[str, float] = {
                "iteration": float(iteration),
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std(unbiased=False)),
                "reward/max": float(rewards.max()),
                "log_prob/mean": float(trajectory.log_probs.mean()),
                **{f"train/{key}": value for key, value in stats.items()},
                f"{TIMING_PREFIX}rollout_s": sampled - started,
                f"{TIMING_PREFIX}step_s": finished - started,
            }
            if iteration == 0:
                metrics["eval/reward_before"] = eval_before
            if iteration == recipe.num_iterations - 1:
                metrics["eval/reward_after"] = evaluate(model, recipe, reward)
            history.append(metrics)
            if sink is not None:
                sink.write(json.dumps(metrics) + "\n")
                sink.flush()
            if on_metrics is not None:
                on_metrics(metrics)
    finally:
        if sink is not None:
            sink.close()
    return history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_diffusion.train", description=__doc__)
    parser.add_argument("recipe", help="a YAML path, or the name of a shipped recipe")
    parser.add_argument("--out", type=Path, default=None, help="directory for metrics.jsonl")
    parser.add_argument("--iterations", type=int, default=None, help="override num_iterations")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    recipe = load_recipe(args.recipe)
    if args.iterations is not None:
        from dataclasses import replace

        recipe = replace(recipe, num_iterations=args.iterations)
    print(f"recipe {recipe.name}: evidence level {recipe.evidence_level}")

    def show(m: dict[str, float]) -> None:
        print(
            f"iter {int(m['iteration'])}: reward {m['reward/mean']:.4f} "
            f"step {m[TIMING_PREFIX + 'step_s']:.2f}s"
        )

    history = run(recipe, args.out, on_metrics=show)
    print(
        f"eval reward before {history[0]['eval/reward_before']:.4f} "
        f"after {history[-1]['eval/reward_after']:.4f}"
    )


if __name__ == "__main__":
    main()
