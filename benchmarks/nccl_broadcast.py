"""NCCL broadcast throughput of the ``broadcast`` transport on two GPUs, against the device-to-device bandwidth.

    python benchmarks/nccl_broadcast.py [--out DIR]        # on a machine with 2 GPUs

Three numbers, in one invocation:

1. device-to-device copy bandwidth, cuda:0 -> cuda:1 (``tensor.to``, 1 GiB, median of 10);
2. raw NCCL broadcast bandwidth between two processes (cuda:0 -> cuda:1, 1 GiB, median of 10):
   the ceiling any NCCL-based transport can reach;
3. the broadcast transport end to end: a ~1.7B-parameter bf16 Qwen3-shaped model streamed from
   cuda:0 into an embedded engine on cuda:1 (512 MB buckets, HTTP per bucket, the engine's staged
   commit), median of 5 updates, as bytes per second; ``--flatten`` sends each bucket as one
   broadcast of its bytes (what a run with the embedded engine does) instead of one per tensor.

Reported: each bandwidth in GB/s and the transport's fraction of (1) and of (2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def d2d_bandwidth(nbytes: int = GiB, iters: int = 10) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for _ in range(iters + 2):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:]) / 1e9


def _nccl_rank(rank: int, port: int, nbytes: int, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
    times = []
    for _ in range(iters + 2):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 1:
        out.put(nbytes / statistics.median(times[2:]) / 1e9)
    dist.destroy_process_group()


def nccl_bandwidth(nbytes: int = GiB, iters: int = 10) -> float:
    import torch.multiprocessing as mp

    from miles_fsdp.backend import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, nbytes, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return result


def build_model(path: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from miles.models.registry import resolve_model

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    with torch.device("cuda:0"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen3")).save_pretrained(path)


def transport_throughput(work: Path, updates: int, bucket_mb: float, flatten: bool) -> dict:
    from safetensors.torch import load_file

    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec
    from miles_transports.broadcast import BroadcastTransport

    model_dir = work / "model"
    build_model(model_dir)
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update({k: v.to("cuda:0") for k, v in load_file(str(f)).items()})
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    launcher = EmbeddedLauncher(startup_timeout_s=600)
    opts = {"device": "cuda:1", "dtype": "bfloat16", "startup_timeout_s": 600}
    try:
        [url] = launcher.launch([EngineSpec(model_path=str(model_dir), options=opts)], str(work / "logs"))
        transport = BroadcastTransport(bucket_mb=bucket_mb, backend="nccl", flatten=flatten)
        transport.connect([url], rank=0, world_size=1, device="cuda:0")
        times = []
        try:
            for version in range(1, updates + 2):
                stats = transport.send(iter(weights.items()), version)
                times.append(stats.seconds)
                print(f"  update {version}: {stats.seconds:.3f} s, {stats.buckets} buckets", flush=True)
        finally:
            transport.close()
    finally:
        launcher.shutdown()
    median = statistics.median(times[1:])  # the first update also sets up NCCL's buffers
    return {
        "flatten": flatten,
        "bucket_mb": bucket_mb,
        "params": sum(t.numel() for t in weights.values()),
        "bytes": nbytes,
        "seconds": times,
        "median_s": median,
        "gb_per_s": nbytes / median / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--flatten", action="store_true", help="one broadcast per bucket (what runs use)")
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        sys.exit("needs 2 GPUs")
    d2d = d2d_bandwidth()
    print(f"device-to-device copy: {d2d:.1f} GB/s", flush=True)
    nccl = nccl_bandwidth()
    print(f"raw NCCL broadcast: {nccl:.1f} GB/s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="miles-nccl-"))
    result = transport_throughput(work, args.updates, args.bucket_mb, args.flatten)
    print(f"broadcast transport: {result['gb_per_s']:.1f} GB/s", flush=True)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "command": "python benchmarks/nccl_broadcast.py",
        "d2d_copy_gb_per_s": d2d,
        "nccl_broadcast_gb_per_s": nccl,
        "transport": result,
        "transport_fraction_of_d2d": result["gb_per_s"] / d2d,
        "transport_fraction_of_nccl": result["gb_per_s"] / nccl,
    }
    os.makedirs(args.out, exist_ok=True)
    name = "nccl_broadcast" + ("" if args.bucket_mb == 512 else f"_bucket{int(args.bucket_mb)}")
    name += "_flat.json" if args.flatten else ".json"
    Path(args.out, name).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "transport"}, indent=2))


if __name__ == "__main__":
    main()
