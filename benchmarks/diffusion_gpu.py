"""Diffusion on one GPU: the engine's images per second beside a plain diffusers pipeline call on
the same model, and the rollout's step time with and without pipelining (issue 19's GPU Measure).

    python3 benchmarks/diffusion_gpu.py [--image-size 512] [--steps 10] [--batch 8] [--guidance 1.0]

The model: a diffusers ``StableDiffusion3Pipeline`` directory with random weights at SD3.5-medium's
shape where it counts: the MMDiT-X transformer (24 blocks of 24 heads x 64, the first 13 with the
second image attention, RMS q/k norms, a 384 x 384 positional grid; 2.24 B parameters) and the
16-channel SD3 VAE (128-256-512-512, two layers a block). Text encoders are one-layer CLIP stand-ins
of CLIP-L / CLIP-G's widths (768, 1280) and no T5, whose 256 tokens are zeros, as in a pipeline
without ``text_encoder_3``: the transformer sees SD3.5's whole 333-token context. Encodings are
computed once per text by both sides, so the stand-ins cost nothing that is timed.

1. **Images per second**: ``B`` images of one prompt, ``S`` steps, ``--guidance`` w.
   - ``miles engine``: ``DiffusionEngine.generate`` in process, BF16 autocast over FP32 weights (the
     engine's ``--dtype bfloat16``), the SDE sampler with a log-probability per step, the VAE decode,
     the whole trajectory (every step's latents) brought to host memory and packed for the wire;
   - ``diffusers bf16``: ``StableDiffusion3Pipeline(...)`` with BF16 weights, ``output_type="pt"``;
   - ``diffusers fp32+autocast``: the same pipeline with FP32 weights under BF16 autocast (the
     engine's numerics: FP32 master weights cast for each matmul).
   Interleaved, one warm-up each, median of ``--repeats``.
2. **Pipelined rollout**: the engine as its own process (``python -m miles_diffusion.engine --device
   cuda --dtype bfloat16``) and the package's ``DiffusionRollout`` against it, as ``miles run``
   drives it: ``--prompts`` x ``--group`` trajectories a step, microgroups of ``--microgroup``,
   modes ``whole`` / ``microgrouped`` / ``pipelined`` interleaved (``diffusion_pipelining.py``), the
   JPEG-compressibility reward on the CPU and a random convnet scorer on the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _bench import RESULTS_DIR, machine_info, write_result
from diffusion_pipelining import Config, ConvScorer, _bench_config

from miles.interfaces import EngineSpec
from miles_diffusion.decode import close_decode_pools
from miles_diffusion.engine.launcher import DiffusionLauncher
from miles_diffusion.engine.server import DiffusionEngine, GenerateBody
from miles_diffusion.group_rewards import ImageGroupReward, JpegCompressibilityReward
from miles_diffusion.model import TinyFlowModelConfig
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.sd3 import TinySD3Config, build_tiny_sd3

TEXT = "a watercolour painting of a lighthouse at dawn"
TEXTS = [TEXT, "a red bicycle leaning on a stone wall", "three apples on a wooden table", "a fox in snow"]


def sd35_medium_shape(image_size: int) -> TinySD3Config:
    return TinySD3Config(
        image_size=image_size,
        latent_channels=16,
        vae_channels=(128, 256, 512, 512),
        vae_layers_per_block=2,
        vae_norm_groups=32,
        num_layers=24,
        attention_head_dim=64,
        num_attention_heads=24,
        joint_attention_dim=4096,
        clip_widths=(768, 1280),
        clip_layers=1,
        clip_heads=4,
        qk_norm="rms_norm",
        dual_attention_layers=tuple(range(13)),
        pos_embed_max_size=384,
    )


def _sync_time(fn: Any) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def images_per_second(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from diffusers import StableDiffusion3Pipeline

    b, s, w = args.batch, args.steps, args.guidance
    engine = DiffusionEngine(
        str(model_dir), device="cuda", max_batch_size=64, precision=PrecisionConfig(compute_dtype="bfloat16")
    )
    guidance = {"guidance_scale": w} if "guidance_scale" in GenerateBody.model_fields else {}
    if w != 1.0 and not guidance:
        raise SystemExit("this checkout's engine has no guidance_scale: run with --guidance 1")
    body = GenerateBody(
        prompts=[0] * b, seeds=list(range(b)), num_steps=s, noise_level=0.7, texts=[TEXT] * b, **guidance
    )
    n_params = sum(p.numel() for p in engine.model.transformer.parameters())
    bf16, fp32 = (
        StableDiffusion3Pipeline.from_pretrained(
            str(model_dir), text_encoder_3=None, tokenizer_3=None, dtype=dtype
        ).to("cuda")
        for dtype in (torch.bfloat16, torch.float32)
    )
    for pipe in (bf16, fp32):
        pipe.set_progress_bar_config(disable=True)
    size = args.image_size

    def call(pipe: Any) -> None:
        pipe(
            prompt=[TEXT] * b,
            num_inference_steps=s,
            guidance_scale=w,
            height=size,
            width=size,
            output_type="pt",
            generator=torch.Generator("cuda").manual_seed(0),
        )

    def autocast_call() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            call(fp32)

    paths = {
        "miles engine": lambda: engine.generate(body),
        "diffusers bf16": lambda: call(bf16),
        "diffusers fp32+autocast": autocast_call,
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():  # warm-up: kernels chosen, encodings cached
        _sync_time(fn)
    for r in range(args.repeats):
        names = list(paths)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_sync_time(paths[name]))
    out: dict[str, Any] = {
        "transformer_parameters": n_params,
        "batch": b,
        "steps": s,
        "guidance_scale": w,
        "image_size": size,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "paths": {},
    }
    for name, ts in times.items():
        median = statistics.median(ts)
        out["paths"][name] = {"s": ts, "median_s": median, "images_per_s": b / median}
        print(f"{name}: {b / median:.2f} images/s (median {median:.3f} s of {len(ts)})", flush=True)
    base = out["paths"]["diffusers bf16"]["median_s"]
    out["engine_vs_diffusers_bf16"] = base / out["paths"]["miles engine"]["median_s"]
    out["engine_vs_diffusers_fp32_autocast"] = (
        out["paths"]["diffusers fp32+autocast"]["median_s"] / out["paths"]["miles engine"]["median_s"]
    )
    return out  # the engine and both pipelines go with this frame


def pipelined_rollout(model_dir: Path, root: str, args: argparse.Namespace) -> dict[str, Any]:
    config = Config(
        "sd35m_gpu", TinyFlowModelConfig(), args.steps, args.prompts, args.group, args.microgroup, "jpeg"
    )
    extra: dict[str, Any] = {"prompts": TEXTS}
    if args.guidance != 1.0:
        extra["guidance_scale"] = args.guidance
    launcher = DiffusionLauncher()
    options = {"device": "cuda", "dtype": "bfloat16", "max_batch_size": 64, "startup_timeout_s": 300}
    scorer = ConvScorer()
    scorer.net.to("cuda")

    def on_gpu(images: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        return scorer(images.to("cuda", non_blocking=True), prompts).cpu()

    rewards = {
        "jpeg_cpu": JpegCompressibilityReward(),
        "conv_scorer_gpu": ImageGroupReward(on_gpu, "conv_scorer"),
    }
    out: dict[str, Any] = {}
    try:
        [url] = launcher.launch([EngineSpec(model_path=str(model_dir), options=options)], root)
        for name, reward in rewards.items():
            entry = asyncio.run(
                _bench_config(
                    config,
                    url,
                    args.rollout_steps,
                    num_prompts=len(TEXTS),
                    extra_options=extra,
                    reward_fn=reward,
                )
            )
            entry["config"] = {
                "prompts_x_group": f"{args.prompts} x {args.group}",
                "microgroup_size": args.microgroup,
                "denoising_steps": args.steps,
                "image_size": args.image_size,
                "reward": name,
            }
            out[name] = entry
            modes = entry["modes"]
            print(
                f"rollout {name}: whole {modes['whole']['median_step_s']:.3f} s, microgrouped "
                f"{modes['microgrouped']['median_step_s']:.3f} s, pipelined {modes['pipelined']['median_step_s']:.3f} s "
                f"(x{entry['pipelined_vs_whole']:.3f} of whole); tail whole {modes['whole']['median_tail_s']:.3f} s, "
                f"pipelined {modes['pipelined']['median_tail_s']:.3f} s",
                flush=True,
            )
    finally:
        launcher.shutdown()
        close_decode_pools()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="denoising steps")
    parser.add_argument("--batch", type=int, default=8, help="images per call (images/s part)")
    parser.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance scale")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="prompts a rollout step")
    parser.add_argument("--group", type=int, default=8, help="trajectories a prompt")
    parser.add_argument("--microgroup", type=int, default=4)
    parser.add_argument("--rollout-steps", type=int, default=3, help="timed rollout steps a mode")
    parser.add_argument("--parts", default="images,rollout")
    parser.add_argument("--out", default=str(RESULTS_DIR / "diffusion_gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diffusion_gpu.py needs a CUDA device")
    result: dict[str, Any] = {
        "machine": machine_info(),
        "gpu": torch.cuda.get_device_name(0),
        "args": vars(args),
    }
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as root:
        model_dir = Path(root) / "sd35m"
        started = time.perf_counter()
        with torch.device("cuda"):  # random init of 2.24 B parameters: seconds on the GPU, minutes on a CPU
            build_tiny_sd3(model_dir, seed=0, config=sd35_medium_shape(args.image_size))
        result["build_s"] = time.perf_counter() - started
        print(f"built {model_dir} in {result['build_s']:.1f} s", flush=True)
        if "images" in parts:
            result["images_per_second"] = images_per_second(model_dir, args)
            torch.cuda.empty_cache()  # the rollout's engine is a process of its own
            write_result(args.out, result)
        if "rollout" in parts:
            result["pipelined_rollout"] = pipelined_rollout(model_dir, root, args)
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
