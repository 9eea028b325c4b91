"""What classifier-free guidance costs the sampler, on the scaled-down SD3 and Wan proxies, on CPU.

    uv run python benchmarks/diffusion_guidance_cost.py [--repeats 15] [--only sd3,wan]

Each proxy (``builtin:tiny-sd3``, ``builtin:tiny-wan``, random weights) is loaded as the engine
loads it, with the prompt texts of its run recipe (``sd3_flow_grpo_proxy`` / ``wan_flow_grpo_proxy``).
The prompts are encoded ahead, once, as the engine encodes a request's prompts; the guided sampler's
empty-prompt encoding is cached by the warm-up. Then ``sample_seeded`` (the engine's sampler: one
stochastic trajectory per prompt, each from its own seed) draws 8 trajectories (the recipe's 4
prompts twice) of 8 SDE steps, noise level 0.7, at ``guidance_scale`` 1.0 (unguided: one forward pass
of 8 rows per step) and 4.5 (guided: one forward pass of 16 rows per step, the empty prompt's rows
first), interleaved (the order alternates each repeat), after one warm-up of each. Reported: the
median wall time of each and the ratio guided / unguided, and the same for the sampling
thread's CPU time (``time.thread_time``: less sensitive to other processes on a shared machine); the VAE decode is not included (it does not
change with guidance). Torch on one thread.

Results go to ``benchmarks/results/diffusion_guidance_cost.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _bench import RESULTS_DIR, load_avg, machine_info, write_result

from miles.config import load_recipe
from miles.models.registry import resolve_model
from miles_diffusion.families import load_model
from miles_diffusion.sampler import SamplerConfig, sample_seeded

PROXIES = {"sd3": "sd3_flow_grpo_proxy", "wan": "wan_flow_grpo_proxy"}
SCALES = (1.0, 4.5)
TRAJECTORIES = 8
STEPS = 8
NOISE_LEVEL = 0.7


def run_proxy(name: str, repeats: int) -> dict[str, Any]:
    recipe = load_recipe(PROXIES[name], [])
    texts = tuple(str(p) for p in recipe.rollout.options["prompts"])
    path = resolve_model(recipe.model.path)
    model: Any = load_model(path, prompts=texts)
    model.eval()
    prompts = torch.tensor([i % len(texts) for i in range(TRAJECTORIES)])
    seeds = list(range(TRAJECTORIES))
    with torch.no_grad():
        distinct, inverse = torch.unique(prompts, return_inverse=True)
        encoded = model.encode_prompts(distinct)[inverse]
    configs = {w: SamplerConfig(num_steps=STEPS, noise_level=NOISE_LEVEL, guidance_scale=w) for w in SCALES}
    times: dict[float, list[float]] = {w: [] for w in SCALES}
    cpu_times: dict[float, list[float]] = {w: [] for w in SCALES}  # this thread's CPU time: less load-bound
    finals: dict[float, torch.Tensor] = {}
    for i in range(repeats + 1):
        order = SCALES if i % 2 == 0 else tuple(reversed(SCALES))
        for w in order:
            start, cpu_start = time.perf_counter(), time.thread_time()
            trajectory = sample_seeded(model, prompts, seeds, configs[w], encoded=encoded)
            elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
            if i:  # the first round is the warm-up (it also caches the empty prompt's encoding)
                times[w].append(elapsed)
                cpu_times[w].append(cpu)
            finals[w] = trajectory.latents[:, -1]
    unguided, guided = (statistics.median(times[w]) for w in SCALES)
    cpu_unguided, cpu_guided = (statistics.median(cpu_times[w]) for w in SCALES)
    return {
        "model": recipe.model.path,
        "recipe": PROXIES[name],
        "transformer_parameters": sum(p.numel() for p in model.transformer.parameters()),
        "latent_shape": list(model.latent_shape),
        "seconds_median": {str(w): statistics.median(times[w]) for w in SCALES},
        "seconds_all": {str(w): times[w] for w in SCALES},
        "ratio_guided_over_unguided": guided / unguided,
        "cpu_seconds_median": {str(w): statistics.median(cpu_times[w]) for w in SCALES},
        "cpu_seconds_all": {str(w): cpu_times[w] for w in SCALES},
        "cpu_ratio_guided_over_unguided": cpu_guided / cpu_unguided,
        # guidance changed the samples (same seeds, same starting noise): the guided path ran
        "final_latents_max_difference": float((finals[SCALES[1]] - finals[SCALES[0]]).abs().max()),
        "load_avg_after": load_avg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default=",".join(PROXIES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "repeats": args.repeats,
        "trajectories": TRAJECTORIES,
        "steps": STEPS,
        "noise_level": NOISE_LEVEL,
        "guidance_scales": list(SCALES),
        "torch_threads": torch.get_num_threads(),
        "proxies": {},
    }
    for name in args.only.split(","):
        out = run_proxy(name, args.repeats)
        result["proxies"][name] = out
        med, cpu = out["seconds_median"], out["cpu_seconds_median"]
        print(
            f"{name}: unguided {med[str(SCALES[0])]:.3f} s, guided (w = {SCALES[1]}) {med[str(SCALES[1])]:.3f} s, "
            f"{out['ratio_guided_over_unguided']:.2f}x (median of {args.repeats}; {TRAJECTORIES} trajectories "
            f"of {STEPS} steps); thread CPU time {cpu[str(SCALES[0])]:.3f} s and {cpu[str(SCALES[1])]:.3f} s, "
            f"{out['cpu_ratio_guided_over_unguided']:.2f}x"
        )
    print(write_result(RESULTS_DIR / "diffusion_guidance_cost.json", result))


if __name__ == "__main__":
    main()
