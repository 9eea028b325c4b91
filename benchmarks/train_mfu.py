"""Training throughput and MFU of the FSDP and Megatron backends, on the same random Qwen3-shaped bf16 model.

    python3 benchmarks/train_mfu.py --out /tmp/fsdp-mfu.json            # GPU: Qwen3-1.7B shape, seq 2048
    uv run python benchmarks/train_mfu.py --shape tiny --device cpu     # a smoke run of the script itself

A random model of the named shape is written once (bf16 safetensors); each configuration then starts
an ``FSDPBackend`` (one rank, bf16 compute, float32 master weights and gradient reduction, AdamW) or,
for the ``megatron*`` ones, a ``MegatronBackend`` (one rank, bf16 parameters, megatron's DDP with
float32 gradient buffers and its Adam with float32 master weights, the local layer spec), and
trains ``--steps`` steps of ``--samples`` sequences of ``--seq`` tokens (``--prompt`` prompt tokens,
the rest response tokens under a PPO-clip loss with random advantages). Per configuration it reports
the median over the steps after ``--warmup`` of: seconds per step, tokens per second, the trainer's
own forward+backward and optimizer times, peak GPU memory, and MFU.

MFU counts the model FLOPs a step needs, not what the kernels did: per token
``6 * (non-embedding parameters) + 12 * layers * heads * head_dim * seq`` (forward + backward of the
dense layers and of causal attention without discounting the masked half, as the usual MFU
formula does), plus ``6 * hidden * vocab`` for the output projection on response tokens only (the
full-logits path also projects the prompt positions; that extra work is not credited). Divided by
the step's seconds and the dense bf16 peak (``--peak-tflops``, 989 for an H200).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-1.7B's published shape (tied embeddings).
    "1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
}

# name -> fsdp options on top of the common ones (micro_batch_size comes from --micro-batch).
# Packed configurations load with the backend's default for packing (miles_varlen: torch's varlen
# flash kernel from the samples' boundaries) unless they name another; "-sdpa" is transformers'
# own packed path (a block-diagonal mask from the position ids), the one measured before.
CONFIGS: dict[str, dict[str, Any]] = {
    "padded-full": {},
    "padded-full-pageable": {"pin_offload": False},  # for --offload-trips: offload through pageable memory
    "padded-chunked": {"logprob_projection": "chunked"},
    "packed-chunked-sdpa": {
        "logprob_projection": "chunked",
        "max_tokens_per_gpu": None,
        "attn_implementation": "sdpa",
    },
    "packed-chunked": {"logprob_projection": "chunked", "max_tokens_per_gpu": None},  # set from args
    "packed-full": {"max_tokens_per_gpu": None},
    "padded-full-compiled": {"compile": True},
    "packed-full-compiled": {"max_tokens_per_gpu": None, "compile": True},
    "packed-chunked-compiled": {"logprob_projection": "chunked", "max_tokens_per_gpu": None, "compile": True},
    "padded-lora": {},  # padded-full with a LoRA adapter (LORA below) in place of full-parameter training
    "packed-lora": {"max_tokens_per_gpu": None},
}
# Issue 18's adapter: rank 16 on every attention and MLP projection (the "-lora" configurations).
LORA = {
    "rank": 16,
    "alpha": 32,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
# name -> megatron options on top of the common ones (padded micro-batches of --micro-batch samples).
MEGATRON_CONFIGS: dict[str, dict[str, Any]] = {
    "megatron": {},  # core_attention sdpa, the default
    "megatron-attn-megatron": {"core_attention": "megatron"},  # megatron-core's own score-matrix attention
    "megatron-streaming": {"optimizer_streaming": True},  # AdamW state on disk, a bucket at a time
}


def build_model(shape: str, seq: int, path: Path, device: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=max(seq, 4096))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model


def model_flops_per_step(shape: str, seq: int, prompt: int, samples: int) -> float:
    s = SHAPES[shape]
    h, layers, inter = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"]
    q = s["num_attention_heads"] * s["head_dim"]
    kv = s["num_key_value_heads"] * s["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter  # q, k, v, o and the gated MLP
    dense = 6 * layers * per_layer
    attention = 12 * layers * q * seq
    head = 6 * h * s["vocab_size"]
    return samples * (seq * (dense + attention) + (seq - prompt) * head)


def make_batch(samples: int, seq: int, prompt: int, vocab: int, step: int) -> Any:
    from miles.types import Prompt, Sample, TrainBatch

    rng = random.Random(step)
    out, advantages = [], []
    for i in range(samples):
        r = seq - prompt
        out.append(
            Sample(
                prompt=Prompt(index=i, prompt=""),
                prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                response_ids=[rng.randrange(vocab) for _ in range(r)],
                rollout_logprobs=[-1.0] * r,
                loss_mask=[1] * r,
                weight_versions=[0] * r,
            )
        )
        advantages.append([rng.choice([-1.0, 1.0])] * r)
    return TrainBatch(samples=out, advantages=advantages, step=step)


def lora_config(model_path: str) -> dict[str, Any]:
    """A whole run config (the ranks rebuild and validate it) whose ``lora`` section is :data:`LORA`."""
    from miles.config import load_recipe

    lora = [f"lora.{k}={json.dumps(v)}" for k, v in LORA.items()]
    return load_recipe("default", [f"model.path={model_path}", *lora]).model_dump(mode="json")


def backend_for(name: str, fsdp: dict[str, Any], args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The unstarted backend of configuration ``name`` and its options (both backends share ``train``)."""
    cuda = args.device == "cuda"
    train = {"lr": 1e-6, "micro_batch_size": args.micro_batch, "grad_clip": 1.0}
    if name in MEGATRON_CONFIGS:
        from miles_megatron.backend import MegatronBackend

        megatron = {
            "device": args.device,
            "params_dtype": "bfloat16" if cuda else "float32",
            **MEGATRON_CONFIGS[name],
        }
        return MegatronBackend(), {"train": train, "megatron": megatron}
    from miles_fsdp.backend import FSDPBackend

    options = {
        "train": train,
        "fsdp": {
            "num_ranks": 1,
            "device": args.device,
            "param_dtype": "bfloat16" if cuda else None,
            "reduce_dtype": "float32" if cuda else None,
            "gradient_checkpointing": args.gradient_checkpointing,
            "startup_timeout_s": 600,
            "command_timeout_s": 600,
            **({"attn_implementation": args.attn} if args.attn else {}),
            **fsdp,
        },
    }
    return FSDPBackend(), options


def run_config(name: str, fsdp: dict[str, Any], args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    from miles.interfaces import BackendSpec

    cuda = args.device == "cuda"
    backend, options = backend_for(name, fsdp, args)
    spec = BackendSpec(
        model_path=model_path,
        loss="ppo_clip",
        correction=None,
        transport="broadcast" if "fsdp" in options else "colocated",
        engine_urls=[],
        temperature=1.0,
        options=options,
        config=lora_config(model_path) if name.endswith("-lora") else None,
    )
    t0 = time.perf_counter()
    try:
        backend.setup(spec)
    except Exception as exc:  # a configuration that cannot start must not lose the others' figures
        return {"config": name, "error": f"setup: {type(exc).__name__}: ...{str(exc)[-700:]}"}
    section = "fsdp" if "fsdp" in options else "megatron"
    result: dict[str, Any] = {"config": name, section: options[section], "setup_s": time.perf_counter() - t0}
    vocab = SHAPES[args.shape]["vocab_size"]
    steps: list[dict[str, float]] = []
    try:
        for step in range(args.warmup + args.steps):
            batch = make_batch(args.samples, args.seq, args.prompt, vocab, step)
            t = time.perf_counter()
            metrics = backend.train_step(batch)
            metrics["wall_s"] = time.perf_counter() - t
            steps.append(metrics)
            print(f"  {name} step {step}: {metrics['wall_s']:.3f} s", flush=True)
        trips = [(backend.offload(), backend.onload()) for _ in range(args.offload_trips)]
    except Exception as exc:  # an OOM in one configuration must not lose the others' figures
        result["error"] = f"{type(exc).__name__}: ...{str(exc)[-700:]}"
        return result
    finally:
        backend.shutdown()
    if trips and "offload/seconds" in trips[0][0]:  # (on the CPU offload is a no-op)
        # The colocated placement's offload and onload of the trainer's whole state (weights, gradients,
        # Adam moments); the first trip also pays for pinning host memory, hence medians.
        off, on = [t[0] for t in trips], [t[1] for t in trips]
        result["offload_gb"] = off[-1]["offload/bytes"] / 1e9
        result["offload_s"] = [m["offload/seconds"] for m in off]
        result["onload_s"] = [m["onload/seconds"] for m in on]
    timed = steps[args.warmup :]
    wall = statistics.median(m["wall_s"] for m in timed)
    tokens = args.samples * args.seq
    flops = model_flops_per_step(args.shape, args.seq, args.prompt, args.samples)
    result.update(
        {
            "step_s": wall,
            "tokens_per_s": tokens / wall,
            "forward_backward_s": statistics.median(m["time/train_step/forward_backward_s"] for m in timed),
            "optimizer_s": statistics.median(m["time/train_step/optimizer_s"] for m in timed),
            "model_tflops_per_step": flops / 1e12,
            "achieved_tflops": flops / wall / 1e12,
            "mfu": flops / wall / (args.peak_tflops * 1e12),
            "loss": [m["train/loss"] for m in steps],
        }
    )
    if cuda:
        result["cuda_peak_gib"] = max(m.get("train/cuda_peak_gib", 0.0) for m in steps)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--samples", type=int, default=32, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=8, help="padded configurations: samples per pass")
    parser.add_argument("--pack-tokens", type=int, default=16384, help="packed configuration: token budget")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--offload-trips",
        type=int,
        default=0,
        help="after the steps, time this many offload/onload round trips",
    )
    parser.add_argument(
        "--attn",
        default=None,
        help="transformers attention backend for every configuration (default: the backend's own choice, "
        "sdpa padded and miles_varlen packed, unless the configuration names one)",
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200: 989)")
    parser.add_argument(
        "--configs",
        default="padded-full,packed-chunked-sdpa,packed-chunked,packed-full,padded-full-compiled,packed-full-compiled",
        help=f"comma-separated, of {list(CONFIGS) + list(MEGATRON_CONFIGS)}",
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    unknown = [n for n in args.configs.split(",") if n not in CONFIGS and n not in MEGATRON_CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; allowed: {list(CONFIGS) + list(MEGATRON_CONFIGS)}")

    import torch

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "args": vars(args),
    }
    import transformers

    info["transformers"] = transformers.__version__
    results = []
    with tempfile.TemporaryDirectory(prefix="fsdp-mfu-") as tmp:
        model_path = Path(tmp) / f"qwen3-{args.shape}"
        t0 = time.perf_counter()
        build_model(args.shape, args.seq, model_path, args.device)
        info["build_s"] = time.perf_counter() - t0
        print(f"model written in {info['build_s']:.1f} s", flush=True)
        for name in args.configs.split(","):
            fsdp = dict(CONFIGS.get(name, {}))
            if "max_tokens_per_gpu" in fsdp:
                fsdp["max_tokens_per_gpu"] = args.pack_tokens
            results.append(run_config(name, fsdp, args, str(model_path)))
            print(json.dumps(results[-1]), flush=True)
    report = {"info": info, "results": results}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    for r in results:
        if "error" in r:
            print(f"{r['config']:>16}: {r['error']}")
        else:
            print(
                f"{r['config']:>16}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tok/s, "
                f"{r['achieved_tflops']:.0f} TFLOP/s, MFU {r['mfu']:.1%} "
                f"(fwd+bwd {r['forward_backward_s']:.3f} s, optimizer {r['optimizer_s']:.3f} s)"
            )


if __name__ == "__main__":
    sys.exit(main())
