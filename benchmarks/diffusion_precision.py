"""Does keeping the timestep embedders and AdaLN modulation in FP32 narrow the BF16 log-prob gap?
The SD3 and Wan proxies, on CPU.

    uv run python benchmarks/diffusion_precision.py [--repeats 9] [--only sd3,wan]

Each proxy (``builtin:tiny-sd3``, ``builtin:tiny-wan``, random weights) is loaded four times from
its directory (the same weights, checked), with the prompt texts of its run recipe
(``sd3_flow_grpo_proxy`` / ``wan_flow_grpo_proxy``), under four ``PrecisionConfig``s:

* ``fp32``: the reference (autocast off);
* ``bf16``: ``compute_dtype="bfloat16"``, nothing kept in FP32;
* ``bf16+time``: BF16 with the timestep embedder kept in FP32;
* ``bf16+time+adaln``: BF16 with the timestep embedder and the AdaLN modulation kept in FP32
  (the patterns are in ``TIME_MODULES`` / ``ADALN_MODULES`` below).

The FP32 model samples 8 trajectories (the recipe's 4 prompts twice, seeds 0..7) of 8 SDE steps,
noise level 0.7, with ``sample_seeded`` (the engine's sampler), once unguided (``guidance_scale`` 1)
and once guided (4.5). Then each of the four models re-scores every step of those trajectories with
``step_log_prob`` (the trainer's re-scoring), and gives the step's velocity (``guided_velocity``).
Reported, against the FP32 re-score: the max and mean over the 8 x 8 (trajectory, step) pairs of
|log-prob - FP32 log-prob| (log-probs are per-pixel means, as the sampler records them), and of the
relative velocity error ||v - v_fp32|| / ||v_fp32|| (per trajectory and step, L2 over the latent);
and the median time of one whole re-score (8 forward passes of 8 rows, 16 rows guided), wall and
the thread's CPU time, the four precisions interleaved (the order rotates each repeat) after one
warm-up. Torch on one thread.

Results go to ``benchmarks/results/diffusion_precision.json``.
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
from miles_diffusion.guidance import guided_velocity
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.sampler import SamplerConfig, Trajectory, sample_seeded, step_log_prob

PROXIES = {"sd3": "sd3_flow_grpo_proxy", "wan": "wan_flow_grpo_proxy"}
TIME_MODULES = {
    # SD3: the timestep embedder and the pooled-text projection it is summed with (one module)
    "sd3": ("transformer.time_text_embed",),
    # Wan: the timestep embedder (sinusoid -> MLP)
    "wan": ("transformer.condition_embedder.time_embedder",),
}
ADALN_MODULES = {
    # SD3: every block's AdaLayerNormZero (image and context streams: SiLU -> Linear -> LayerNorm ->
    # scale/shift) and the final AdaLayerNormContinuous
    "sd3": (
        "transformer.transformer_blocks.*.norm1",
        "transformer.transformer_blocks.*.norm1_context",
        "transformer.norm_out",
    ),
    # Wan: the projection of the time embedding to the blocks' 6 x dim modulation (shared by all
    # blocks). diffusers' Wan blocks already add scale_shift_table in FP32 (``temb.float()``) and
    # run norm1/2/3 as FP32LayerNorm, so that part needs no pattern.
    "wan": ("transformer.condition_embedder.time_proj",),
}
SCALES = (1.0, 4.5)
TRAJECTORIES = 8
STEPS = 8
NOISE_LEVEL = 0.7


def precisions(name: str) -> dict[str, PrecisionConfig]:
    return {
        "fp32": PrecisionConfig(),
        "bf16": PrecisionConfig("bfloat16"),
        "bf16+time": PrecisionConfig("bfloat16", TIME_MODULES[name]),
        "bf16+time+adaln": PrecisionConfig("bfloat16", TIME_MODULES[name] + ADALN_MODULES[name]),
    }


@torch.no_grad()
def rescore(model: Any, trajectory: Trajectory, scale: float) -> torch.Tensor:
    """Every step's log-probability under ``model``, [B, S] (the trainer's re-scoring)."""
    return torch.stack(
        [step_log_prob(model, trajectory, i, NOISE_LEVEL, scale)[0] for i in range(trajectory.num_steps)],
        dim=1,
    )


@torch.no_grad()
def velocities(model: Any, trajectory: Trajectory, scale: float) -> torch.Tensor:
    """Every step's (guided) velocity under ``model``, [S, B, ...]."""
    out = []
    for i in range(trajectory.num_steps):
        x = trajectory.latents[:, i]
        t = torch.full((x.shape[0],), float(trajectory.timesteps[i]))
        out.append(guided_velocity(model, x, t, trajectory.prompts, scale))
    return torch.stack(out)


def summary(values: torch.Tensor) -> dict[str, float]:
    return {"max": float(values.max()), "mean": float(values.mean())}


def run_proxy(name: str, repeats: int) -> dict[str, Any]:
    recipe = load_recipe(PROXIES[name], [])
    texts = tuple(str(p) for p in recipe.rollout.options["prompts"])
    path = resolve_model(recipe.model.path)
    configs = precisions(name)
    models: dict[str, Any] = {
        key: load_model(path, precision, prompts=texts).eval() for key, precision in configs.items()
    }
    reference = models["fp32"].state_dict()
    for key, model in models.items():  # the same FP32 master weights under every precision
        state = model.state_dict()
        assert state.keys() == reference.keys() and all(
            torch.equal(state[k], reference[k]) for k in reference
        ), key
    prompts = torch.tensor([i % len(texts) for i in range(TRAJECTORIES)])
    seeds = list(range(TRAJECTORIES))
    out: dict[str, Any] = {
        "model": recipe.model.path,
        "recipe": PROXIES[name],
        "transformer_parameters": sum(p.numel() for p in models["fp32"].transformer.parameters()),
        "latent_shape": list(models["fp32"].latent_shape),
        "fp32_modules": {key: list(models[key].fp32_modules) for key in configs},
        "patterns": {key: list(precision.fp32_modules) for key, precision in configs.items()},
        "guidance": {},
    }
    for scale in SCALES:
        sampler = SamplerConfig(num_steps=STEPS, noise_level=NOISE_LEVEL, guidance_scale=scale)
        trajectory = sample_seeded(models["fp32"], prompts, seeds, sampler)
        log_probs = {key: rescore(model, trajectory, scale) for key, model in models.items()}
        vel = {key: velocities(model, trajectory, scale) for key, model in models.items()}
        v_ref = vel["fp32"].flatten(2)
        times: dict[str, list[float]] = {key: [] for key in models}
        cpu_times: dict[str, list[float]] = {key: [] for key in models}
        keys = list(models)
        for r in range(repeats + 1):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            for key in order:
                start, cpu_start = time.perf_counter(), time.thread_time()
                rescore(models[key], trajectory, scale)
                elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
                if r:  # round 0 is the warm-up
                    times[key].append(elapsed)
                    cpu_times[key].append(cpu)
        per: dict[str, Any] = {}
        for key in models:
            lp_gap = (log_probs[key] - log_probs["fp32"]).abs()
            v_err = (vel[key].flatten(2) - v_ref).norm(dim=2) / v_ref.norm(dim=2)
            per[key] = {
                "log_prob_abs_diff": summary(lp_gap),
                "velocity_rel_err": summary(v_err),
                "log_prob_abs_diff_by_step_max": lp_gap.max(dim=0).values.tolist(),
                "seconds_median": statistics.median(times[key]),
                "seconds_all": times[key],
                "cpu_seconds_median": statistics.median(cpu_times[key]),
            }
        out["guidance"][str(scale)] = {
            # the FP32 re-score against what the FP32 sampler recorded (same model, same batch)
            "fp32_rescore_vs_sampler_max_diff": float((log_probs["fp32"] - trajectory.log_probs).abs().max()),
            "log_prob_fp32_mean_abs": float(log_probs["fp32"].abs().mean()),
            "precisions": per,
            "ratio_kept_over_plain_bf16": {
                key: {
                    metric: {
                        stat: per[key][metric][stat] / per["bf16"][metric][stat] for stat in ("max", "mean")
                    }
                    for metric in ("log_prob_abs_diff", "velocity_rel_err")
                }
                for key in ("bf16+time", "bf16+time+adaln")
            },
        }
    out["load_avg_after"] = load_avg()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
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
        for scale, g in out["guidance"].items():
            for key, p in g["precisions"].items():
                lp, v = p["log_prob_abs_diff"], p["velocity_rel_err"]
                print(
                    f"{name} w={scale} {key:16s} |dlogp| max {lp['max']:.3e} mean {lp['mean']:.3e}; "
                    f"v rel err max {v['max']:.3e} mean {v['mean']:.3e}; re-score {p['seconds_median']:.3f} s "
                    f"(cpu {p['cpu_seconds_median']:.3f} s)"
                )
    print(write_result(RESULTS_DIR / "diffusion_precision.json", result))


if __name__ == "__main__":
    main()
