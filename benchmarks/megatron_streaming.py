"""Optimizer-state streaming on the megatron backend, on CPU: resident optimizer bytes and step time.

    uv run python benchmarks/megatron_streaming.py [--steps 5] [--bucket-mb 4]

One random Qwen3-shaped checkpoint (hidden 256, 4 layers, vocabulary 8192, untied: about 6.5M
parameters), float32, trained by the real ``MegatronBackend`` on one gloo rank
(``megatron.device: cpu``) on the same SFT batch, in four configurations, each in its own
process (so each one's peak RSS is its own): torch's AdamW (the CPU trainer's default),
streaming with FP32 moments, streaming with BF16 moments, and streaming without prefetch.
Reported per configuration: the optimizer's resident bytes at their peak (torch: its state
tensors; streaming: ``StreamingAdamW.peak_resident_bytes``, the bucket files loaded at once),
the state's bytes in all, the median train-step and optimizer-step seconds over ``--steps``
steps after one warm-up step, the process's peak RSS, and the final loss (equal across FP32
runs). The model's parameters are FP32 here, so torch's AdamW keeps no master copy; on a GPU
with BF16 parameters megatron's optimizer adds FP32 masters, which streaming also moves to disk.
Results go to ``benchmarks/results/megatron_streaming.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "megatron"))

from _bench import RESULTS_DIR, machine_info

SHAPE = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
)
CONFIGS: dict[str, dict[str, Any]] = {
    "torch_adamw": {},
    "streamed_fp32": {"optimizer_streaming": True},
    "streamed_bf16_moments": {"optimizer_streaming": True, "optimizer_streaming_moments": "bfloat16"},
    "streamed_no_prefetch": {"optimizer_streaming": True, "optimizer_streaming_prefetch": False},
}


def run_one(name: str, model: str, steps: int, bucket_mb: float) -> dict[str, Any]:
    """One configuration in this process: setup, a warm-up step, ``steps`` timed steps."""
    import torch
    from megatron_helpers import make_batch

    from miles.interfaces import BackendSpec
    from miles_megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    megatron: dict[str, Any] = {"device": "cpu", "params_dtype": "float32", **CONFIGS[name]}
    if megatron.get("optimizer_streaming"):
        megatron["optimizer_streaming_bucket_mb"] = bucket_mb
    spec = BackendSpec(
        model_path=model,
        loss="sft",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={"train": {"lr": 1e-3, "micro_batch_size": 8, "grad_clip": 1.0}, "megatron": megatron},
    )
    backend = MegatronBackend()
    backend.setup(spec)
    try:
        batch = make_batch(8, seed=3, vocab=SHAPE["vocab_size"])
        backend.train_step(batch)  # warm-up: torch's AdamW allocates its state here
        step_s, opt_s, loss = [], [], 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            m = backend.train_step(batch)
            step_s.append(time.perf_counter() - t0)
            opt_s.append(m["time/train_step/optimizer_s"])
            loss = m["train/loss"]
        trainer = backend.trainer
        params = [p for p in trainer.gpt.parameters() if p.requires_grad]
        if trainer.streaming is not None:
            opt = trainer.streaming
            resident = opt.peak_resident_bytes
            state = opt.disk_bytes()
            buckets = len(opt.buckets)
        else:
            resident = sum(
                t.numel() * t.element_size()
                for st in trainer.optimizer.state.values()
                for t in st.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0
            )
            state, buckets = resident, 0
        return {
            "config": name,
            "parameters": sum(p.numel() for p in params),
            "buckets": buckets,
            "optimizer_resident_peak_bytes": resident,
            "optimizer_state_bytes": state,
            "step_s_median": statistics.median(step_s),
            "optimizer_s_median": statistics.median(opt_s),
            "final_loss": loss,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    finally:
        backend.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--one", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.model, args.steps, args.bucket_mb)))
        return
    from megatron_helpers import make_checkpoint

    info = machine_info()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_checkpoint("qwen3", Path(tmp) / "hf", **SHAPE))
        for name in CONFIGS:
            cmd = [sys.executable, __file__, "--one", name, "--model", model]
            cmd += ["--steps", str(args.steps), "--bucket-mb", str(args.bucket_mb)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"{name:24s} resident {row['optimizer_resident_peak_bytes'] / 2**20:8.2f} MiB of "
                f"{row['optimizer_state_bytes'] / 2**20:7.2f} MiB ({row['buckets']} buckets)  step "
                f"{row['step_s_median']:.3f} s  optimizer {row['optimizer_s_median']:.3f} s  "
                f"rss {row['peak_rss_mib']:.0f} MiB  loss {row['final_loss']:.6f}",
                flush=True,
            )
    info["load_avg_at_end"] = os.getloadavg()
    result = {"machine": info, "shape": SHAPE, "steps": args.steps, "bucket_mb": args.bucket_mb, "rows": rows}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "megatron_streaming.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
