"""Self-contained diffusion driver: ``python -m miles_diffusion.train RECIPE --out DIR``.

Not yet the core ``miles run`` loop: it samples, scores and trains in one process with the package's
own typed pieces, and writes one JSON line of metrics per iteration to ``DIR/metrics.jsonl``. The
recipe's objective decides what an iteration trains on: a rollout objective (Flow-GRPO, DiffusionNFT)
on images the model samples and the reward scores, a supervised one (SFT) on a batch of given images.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles_diffusion.datasets import ImageDataset, build_shapes_dataset, class_mean_colours
from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.deterministic import check_attention_backends, deterministic_mode
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model
from miles_diffusion.objectives import (
    ObjectiveContext,
    Rollout,
    RolloutObjective,
    SupervisedObjective,
    build_objective,
)
from miles_diffusion.recipe import DiffusionRecipe, load_recipe
from miles_diffusion.rewards import ImageReward, load_reward
from miles_diffusion.sampler import Trajectory, sample
from miles_diffusion.sft import evaluation_loss

TIMING_PREFIX = "time/"
"""Metrics under this prefix are wall-clock times: registered, but not repeatable bit for bit."""


def resolve_model_dir(ref: str) -> Path:
    """A recipe's model directory: ``builtin:NAME`` built into the model cache on first use (the
    ``miles.models`` entry points), anything else a local directory."""
    from miles.models.registry import BUILTIN_PREFIX, build_model

    if ref.startswith(BUILTIN_PREFIX):
        return build_model(ref[len(BUILTIN_PREFIX) :])
    return Path(ref).expanduser()


def build_recipe_model(recipe: DiffusionRecipe) -> DiffusionModel:
    """The recipe's model: the tiny UNet built from its shape and ``seed``, or a model directory
    loaded by its family (:mod:`miles_diffusion.families`) with the recipe's prompt texts."""
    if isinstance(recipe.model, TinyFlowModelConfig):
        return build_tiny_model(recipe.model, recipe.seed, recipe.precision)
    from miles_diffusion.families import check_family_guidance, family_for, load_model

    directory = resolve_model_dir(recipe.model)
    check_family_guidance(family_for(directory), recipe.sampler.guidance_scale)  # before loading
    return load_model(directory, recipe.precision, recipe.prompts or ())


def evaluation_samples(model: DiffusionModel, recipe: DiffusionRecipe) -> Trajectory:
    """Samples for a fixed set of prompts and a fixed seed, so runs compare like for like."""
    prompts = torch.arange(model.num_prompts).repeat_interleave(recipe.eval_prompts_per_id)
    generator = torch.Generator().manual_seed(recipe.eval_seed)
    return sample(model, prompts, recipe.sampler, generator)


def evaluate(model: DiffusionModel, recipe: DiffusionRecipe, reward: ImageReward) -> float:
    """Mean reward over :func:`evaluation_samples`."""
    trajectory = evaluation_samples(model, recipe)
    return float(reward(model.to_images(trajectory.latents[:, -1]), trajectory.prompts).mean())


def _evaluate_all(
    model: DiffusionModel,
    recipe: DiffusionRecipe,
    reward: ImageReward | None,
    dataset: ImageDataset | None,
    suffix: str,
) -> dict[str, float]:
    """``eval/reward`` with a reward; with a dataset also the held-out flow-matching loss and how far
    the samples' mean colour per prompt is from the training set's (mean squared RGB distance)."""
    out: dict[str, float] = {}
    if reward is None and dataset is None:
        return out
    trajectory = evaluation_samples(model, recipe)
    images = model.to_images(trajectory.latents[:, -1])
    if reward is not None:
        out[f"eval/reward_{suffix}"] = float(reward(images, trajectory.prompts).mean())
    if dataset is not None:
        out[f"eval/loss_{suffix}"] = evaluation_loss(model, dataset.held_out, recipe.eval_seed)
        k = model.num_prompts
        sampled = class_mean_colours(images, trajectory.prompts, k)
        train = dataset.train
        given = class_mean_colours((train.images + 1.0) / 2.0, train.prompts, k)
        out[f"eval/colour_error_{suffix}"] = float(((sampled - given) ** 2).sum(dim=1).mean())
    return out


def run(
    recipe: DiffusionRecipe,
    out_dir: Path | None = None,
    on_metrics: Callable[[dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Train ``recipe`` for its iterations; return (and optionally write) the metrics of each.

    In deterministic mode, torch's deterministic-algorithms switch is on for the run and restored after.
    With ``trainer.fsdp_ranks`` above 1 the run is that many spawned local ranks (gloo, CPU); see
    :func:`_run_ranks`.
    """
    if recipe.trainer.fsdp_ranks > 1:
        if isinstance(recipe.model, str):  # judged from the directory, before any rank starts
            from miles_diffusion.wan import is_two_expert_directory, two_expert_refusal

            directory = resolve_model_dir(recipe.model)
            if is_two_expert_directory(directory):
                raise ValueError(
                    two_expert_refusal(f"recipe {recipe.name}: {directory}", "FSDP (fsdp_ranks)")
                )
        if recipe.trainer.sequence_parallel > 1:  # judged from the directory, before any rank starts
            from miles_diffusion.sequence_parallel import check_sequence_parallel

            assert isinstance(recipe.model, str)  # the recipe refused the tiny UNet's shape
            check_sequence_parallel(resolve_model_dir(recipe.model), recipe.trainer.sequence_parallel)
        return _run_ranks(recipe, out_dir, on_metrics)
    mode = deterministic_mode(recipe.seed) if recipe.deterministic else contextlib.nullcontext()
    with mode:
        return _run(recipe, out_dir, on_metrics)


def _run_ranks(
    recipe: DiffusionRecipe,
    out_dir: Path | None,
    on_metrics: Callable[[dict[str, float]], None] | None,
) -> list[dict[str, float]]:
    """``trainer.fsdp_ranks`` local rank processes over gloo (127.0.0.1, a free port), each running the
    whole iteration: every rank samples and scores the same rollout from the same seeded generator
    through the sharded model, and trains its share of it (:func:`miles_diffusion.fsdp.data_parallel`).
    Rank 0 writes ``metrics.jsonl``; ``on_metrics`` sees each iteration's metrics after the ranks end."""
    import tempfile

    import torch.multiprocessing as torch_mp

    from miles_fsdp.ranks import free_port

    with tempfile.TemporaryDirectory(prefix="miles-diffusion-ranks-") as tmp:
        history_file = Path(tmp) / "history.json"
        torch_mp.spawn(
            _rank_main,
            args=(recipe, free_port(), out_dir, history_file, torch.get_num_threads()),
            nprocs=recipe.trainer.fsdp_ranks,
            join=True,
        )
        history: list[dict[str, float]] = json.loads(history_file.read_text())
    if on_metrics is not None:
        for metrics in history:
            on_metrics(metrics)
    return history


def _rank_main(
    rank: int, recipe: DiffusionRecipe, port: int, out_dir: Path | None, history_file: Path, threads: int
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    world = recipe.trainer.fsdp_ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mode = deterministic_mode(recipe.seed) if recipe.deterministic else contextlib.nullcontext()
        with mode:
            history = _run(recipe, out_dir if rank == 0 else None, None)
        if rank == 0:
            history_file.write_text(json.dumps(history))
    finally:
        dist.destroy_process_group()


def _rollout_metrics(
    recipe: DiffusionRecipe,
    model: DiffusionModel,
    objective: RolloutObjective,
    reward: ImageReward,
    generator: torch.Generator,
) -> dict[str, float]:
    started = time.perf_counter()
    ids = torch.randint(model.num_prompts, (recipe.prompts_per_iteration,), generator=generator)
    prompts = ids.repeat_interleave(recipe.group_size)
    trajectory = sample(model, prompts, recipe.sampler, generator)
    sampled = time.perf_counter()
    rewards = reward(model.to_images(trajectory.latents[:, -1]), prompts)
    stats = objective.train_on_rollout(Rollout(trajectory, rewards, recipe.group_size), generator)
    finished = time.perf_counter()
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/max": float(rewards.max()),
        "log_prob/mean": float(trajectory.log_probs.mean()),
        **{f"train/{key}": value for key, value in stats.items()},
        f"{TIMING_PREFIX}rollout_s": sampled - started,
        f"{TIMING_PREFIX}step_s": finished - started,
    }


def _supervised_metrics(
    objective: SupervisedObjective, dataset: ImageDataset, generator: torch.Generator
) -> dict[str, float]:
    started = time.perf_counter()
    stats = objective.train_on_batch(dataset.batch(generator), generator)
    return {
        **{f"train/{key}": value for key, value in stats.items()},
        f"{TIMING_PREFIX}step_s": time.perf_counter() - started,
    }


def _run(
    recipe: DiffusionRecipe,
    out_dir: Path | None,
    on_metrics: Callable[[dict[str, float]], None] | None,
) -> list[dict[str, float]]:
    model = build_recipe_model(recipe)
    model.eval()
    if recipe.deterministic:
        check_attention_backends(model)
    peft_model = _wrap_lora(recipe, model)  # before the objective: its optimizer takes the adapter only
    reward = load_reward(recipe.reward.name, recipe.reward.options) if recipe.reward else None
    objective = build_objective(recipe.objective, ObjectiveContext(model, recipe.trainer, recipe.sampler))
    if recipe.trainer.fsdp_ranks > 1:
        from miles_diffusion.fsdp import data_parallel

        data_parallel(objective, recipe.precision, recipe.trainer.sequence_parallel)
    dataset: ImageDataset | None = None
    if isinstance(objective, SupervisedObjective):
        if recipe.dataset is None:
            raise ValueError(f"recipe {recipe.name}: objective {recipe.objective.name!r} needs a dataset")
        if not isinstance(recipe.model, TinyFlowModelConfig):
            raise ValueError(
                f"recipe {recipe.name}: objective {recipe.objective.name!r} trains on pixel-space images; "
                "only the tiny UNet (a `model:` shape) takes them so far"
            )
        dataset = build_shapes_dataset(recipe.dataset, recipe.model.image_size, recipe.model.num_prompts)
    elif reward is None:
        raise ValueError(f"recipe {recipe.name}: objective {recipe.objective.name!r} needs a reward")
    generator = torch.Generator().manual_seed(recipe.seed)
    history: list[dict[str, float]] = []
    sink = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        sink = (out_dir / "metrics.jsonl").open("w")
    try:
        eval_before = _evaluate_all(model, recipe, reward, dataset, "before")
        for iteration in range(recipe.num_iterations):
            metrics: dict[str, float] = {"iteration": float(iteration)}
            if isinstance(objective, SupervisedObjective):
                assert dataset is not None
                metrics.update(_supervised_metrics(objective, dataset, generator))
            else:
                assert reward is not None
                metrics.update(_rollout_metrics(recipe, model, objective, reward, generator))
            if iteration == 0:
                metrics.update(eval_before)
            if iteration == recipe.num_iterations - 1:
                metrics.update(_evaluate_all(model, recipe, reward, dataset, "after"))
            history.append(metrics)
            if sink is not None:
                sink.write(json.dumps(metrics) + "\n")
                sink.flush()
            if on_metrics is not None:
                on_metrics(metrics)
    finally:
        if sink is not None:
            sink.close()
    if peft_model is not None and out_dir is not None:
        from miles_diffusion import lora as lora_mod

        lora_mod.save_adapter(peft_model, out_dir / ADAPTER_DIR)
    return history


ADAPTER_DIR = "adapter"
"""Where a LoRA recipe's trained adapter goes under ``--out``: a peft adapter directory."""


def _wrap_lora(recipe: DiffusionRecipe, model: DiffusionModel) -> Any:
    """The peft model around the recipe's adapter root (None without ``lora``): the tiny UNet model
    or a pipeline family's transformer, its targets checked first (one ValueError naming the allowed)."""
    if recipe.lora is None:
        return None
    from miles.errors import ConfigError
    from miles_diffusion import lora as lora_mod

    base = str(resolve_model_dir(recipe.model)) if isinstance(recipe.model, str) else ""
    try:
        return lora_mod.wrap(model, recipe.lora, base)
    except ConfigError as exc:
        raise ValueError(f"recipe {recipe.name}: {exc}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_diffusion.train", description=__doc__)
    parser.add_argument("recipe", help="a YAML path, or the name of a shipped recipe")
    parser.add_argument("--out", type=Path, default=None, help="directory for metrics.jsonl")
    parser.add_argument("--iterations", type=int, default=None, help="override num_iterations")
    parser.add_argument(
        "--model", default=None, help="override the recipe's model directory (a path or builtin:NAME)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    recipe = load_recipe(args.recipe)
    from dataclasses import replace

    if args.iterations is not None:
        recipe = replace(recipe, num_iterations=args.iterations)
    if args.model is not None:
        if isinstance(recipe.model, TinyFlowModelConfig):
            raise SystemExit(
                f"recipe {recipe.name} builds the tiny UNet from its shape; --model does not apply"
            )
        recipe = replace(recipe, model=args.model)
    print(f"recipe {recipe.name}: evidence level {recipe.evidence_level}")

    def show(m: dict[str, float]) -> None:
        shown = f"reward {m['reward/mean']:.4f}" if "reward/mean" in m else f"loss {m['train/loss']:.4f}"
        print(f"iter {int(m['iteration'])}: {shown} step {m[TIMING_PREFIX + 'step_s']:.2f}s")

    history = run(recipe, args.out, on_metrics=show)
    for key in sorted(history[0]):
        if key.startswith("eval/") and key.endswith("_before"):
            name = key.removesuffix("_before")
            after = history[-1][f"{name}_after"]
            print(f"{name} before {history[0][key]:.4f} after {after:.4f}")


if __name__ == "__main__":
    main()
