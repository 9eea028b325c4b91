"""Flow-GRPO on the scaled-down Stable Diffusion 3 proxy, on CPU: reward curve, step time, and the
sampler against a plain diffusers ``StableDiffusion3Pipeline`` call on the same directory.

    uv run python benchmarks/diffusion_sd3_proxy.py [--iterations 40] [--batch 16] [--repeats 5]

1. Trains the shipped ``sd3_flow_grpo_proxy`` recipe (``builtin:tiny-sd3``; deterministic mode,
   torch on one thread) and reports the evaluation reward before and after, the rollout reward of
   each iteration and the median seconds per iteration (first not counted); the curve goes to
   ``docs/img/diffusion_sd3_proxy.png``.
2. Images per second on the same (untrained) directory, batch ``--batch``, the recipe's step count:
   the Flow-GRPO SDE sampler (every latent and a log-probability per step recorded) plus the VAE
   decode, against diffusers' own ``StableDiffusion3Pipeline`` (guidance scale 1, so no
   classifier-free guidance, as the sampler; images decoded, ``output_type="pt"``). Median of
   ``--repeats`` timed runs after one warm-up, the two alternating.

Results go to ``benchmarks/results/diffusion_sd3_proxy.json``.
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

from miles_diffusion.families import load_model
from miles_diffusion.recipe import load_recipe
from miles_diffusion.sampler import sample
from miles_diffusion.train import TIMING_PREFIX, resolve_model_dir, run


def images_per_second(fns: list[Any], batch: int, repeats: int) -> list[float]:
    """Each function's images per second; the runs alternate (one of each per repeat), so a load
    change on a shared machine hits all of them alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, kept in zip(fns, times, strict=True):
            started = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - started)
    return [batch / statistics.median(t) for t in times]


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
    ax.set_ylabel("brightness of the decoded images")
    ax.set_title("Flow-GRPO, scaled-down random SD3 pipeline (tiny-sd3), CPU")
    ax.legend(loc="upper left")
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
    recipe = load_recipe("sd3_flow_grpo_proxy")
    if args.iterations is not None:
        recipe = replace(recipe, num_iterations=args.iterations)
    history = run(recipe)
    step_times = [m[f"{TIMING_PREFIX}step_s"] for m in history[1:]]
    rollout_times = [m[f"{TIMING_PREFIX}rollout_s"] for m in history[1:]]
    png = REPO / "docs" / "img" / "diffusion_sd3_proxy.png"
    plotted = plot(history, png)

    from diffusers import StableDiffusion3Pipeline

    assert isinstance(recipe.model, str) and recipe.prompts
    directory = resolve_model_dir(recipe.model)
    model = load_model(directory, prompts=recipe.prompts).eval()
    ids = torch.arange(args.batch) % model.num_prompts
    texts = [recipe.prompts[int(i)] for i in ids]
    steps = recipe.sampler.num_steps
    pipe: Any = StableDiffusion3Pipeline.from_pretrained(
        str(directory), text_encoder_3=None, tokenizer_3=None, dtype=torch.float32
    )
    pipe.set_progress_bar_config(disable=True)
    size = model.latent_shape[1] * 4  # the proxy's VAE: 4x

    def ours() -> torch.Tensor:
        trajectory = sample(model, ids, recipe.sampler, torch.Generator().manual_seed(0))
        return model.to_images(trajectory.latents[:, -1])

    def theirs() -> torch.Tensor:
        out = pipe(
            prompt=texts,
            num_inference_steps=steps,
            guidance_scale=1.0,
            height=size,
            width=size,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
        )
        return out.images

    sde, plain = images_per_second([ours, theirs], args.batch, args.repeats)
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
            "flow_grpo_sde_plus_decode_images_per_s": sde,
            "diffusers_sd3_pipeline_images_per_s": plain,
            "ratio": sde / plain,
        },
        "png": str(png.relative_to(REPO)) if plotted else None,
    }
    out = write_result(RESULTS_DIR / "diffusion_sd3_proxy.json", result)
    print(
        f"eval reward {result['eval_reward_before']:.4f} -> {result['eval_reward_after']:.4f}; "
        f"median step {result['median_step_s']:.3f} s; {sde:.1f} img/s (SDE + log-probs + decode) "
        f"vs {plain:.1f} img/s (StableDiffusion3Pipeline); wrote {out}"
    )


if __name__ == "__main__":
    main()
