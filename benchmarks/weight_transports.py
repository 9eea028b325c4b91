"""Weight transports on CPU with a ~0.5B-parameter model: time and bytes per update, side by side.

    uv run --extra p2p python benchmarks/weight_transports.py [--updates 3] [--methods ...]

One embedded engine serves a randomly initialised Qwen3-shaped model of ~0.5B
parameters in bfloat16. The "trainer" is this process: it keeps float32 master
weights and, before every update, takes one AdamW step at a small learning rate on a
random gradient (the first AdamW step moves each weight by lr·sign(g): m̂/√v̂ = g/|g|),
then sends the bf16 weights through each transport in turn:

* ``full``: the baseline: save a full safetensors checkpoint (fsynced, as the delta's files
  are), the engine reloads it (``/update_weights_from_disk``);
* ``broadcast``: torch.distributed broadcast over gloo into the engine, bucketed;
* ``p2p``: Mooncake TransferEngine writes over TCP into the engine's registered buffer;
* ``disk-delta-xor`` / ``disk-delta-overwrite``: only the changed bytes, published to disk.

Every method is checked: after its updates, the engine's tensor digests must equal the
trainer's. Reported per method: median seconds per update, bytes moved per update,
and (for disk-delta) the changed-byte density. Results go to
``benchmarks/results/weight_transports.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("full", "broadcast", "p2p", "disk-delta-xor", "disk-delta-overwrite")


def build_model(path: Path, seed: int = 0) -> None:
    """A Qwen3-shaped model with Qwen2.5-0.5B's dimensions, random weights, saved in bfloat16."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    from miles.models.registry import resolve_model

    AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen3")).save_pretrained(path)


class Trainer:
    """Float32 master weights and an AdamW first step on a random gradient."""

    def __init__(self, model_dir: Path, lr: float, seed: int = 1) -> None:
        import torch
        from safetensors.torch import load_file

        self.master = {
            name: t.float()
            for f in sorted(model_dir.glob("*.safetensors"))
            for name, t in load_file(f).items()
        }
        self.lr = lr
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        import torch

        for w in self.master.values():
            g = torch.randn(w.shape, generator=self.gen)
            w.sub_(self.lr * torch.sign(g))

    def weights(self):
        import torch

        for name, w in self.master.items():
            yield name, w.to(torch.bfloat16)

    def nbytes(self) -> int:
        return sum(w.numel() * 2 for w in self.master.values())


def engine_digests(url: str) -> dict[str, str]:
    from miles.engines.client import SyncEngineClient

    with SyncEngineClient(url, timeout=600) as client:
        return {name: info["digest"] for name, info in client.weights_checker("checksum").items()}


def trainer_digests(trainer: Trainer) -> dict[str, str]:
    from miles.engines.digest import tensor_digest

    return {name: tensor_digest(t) for name, t in trainer.weights()}


def make_transport(method: str, work: Path, bucket_mb: int):
    if method == "broadcast":
        from miles_transports.broadcast import BroadcastTransport

        return BroadcastTransport(bucket_mb=bucket_mb, backend="gloo")
    if method == "p2p":
        from miles_transports.p2p.transport import P2PTransport

        return P2PTransport(bucket_mb=bucket_mb)
    if method.startswith("disk-delta"):
        from miles_transports.disk_delta import DiskDeltaTransport

        return DiskDeltaTransport(delta_dir=str(work / "deltas"), encoding=method.rsplit("-", 1)[1])
    raise ValueError(method)


def run_full(url: str, trainer: Trainer, work: Path, version: int) -> tuple[float, int]:
    """Save a full safetensors checkpoint and have the engine reload it."""
    from safetensors.torch import save_file

    from miles.engines.client import SyncEngineClient

    t0 = time.perf_counter()
    ckpt = work / f"full-{version}"
    ckpt.mkdir()
    state = dict(trainer.weights())
    state.pop("lm_head.weight", None)  # tied to the embedding
    save_file(state, str(ckpt / "model.safetensors"))
    shutil.copy(work / "model" / "config.json", ckpt / "config.json")
    # Durable, like the delta's files (each fsynced before its index): a publish must survive a crash.
    for name in ("model.safetensors", "config.json"):
        fd = os.open(ckpt / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    with SyncEngineClient(url, timeout=600) as client:
        client.update_weights_from_disk(str(ckpt), weight_version=str(version))
    seconds = time.perf_counter() - t0
    nbytes = (ckpt / "model.safetensors").stat().st_size
    shutil.rmtree(ckpt)
    return seconds, nbytes


def bench_method(method: str, args, work: Path, model_dir: Path) -> dict:
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from engine.helpers import running_engine  # the same launcher path a run uses

    trainer = Trainer(model_dir, lr=args.lr)
    options = {"dtype": "bfloat16", "torch_threads": 1, "startup_timeout_s": 600}
    if method.startswith("disk-delta"):
        options["delta_root"] = str(work / "deltas")
    times, moved, extra = [], [], []
    with running_engine(model_dir, work / f"logs-{method}", **options) as url:
        transport = None
        if method != "full":
            transport = make_transport(method, work, args.bucket_mb)
            transport.connect([url], rank=0, world_size=1, device="cpu")
            if getattr(transport, "wants_base_weights", False):
                transport.seed(trainer.weights(), 0)
        try:
            for version in range(1, args.updates + 1):
                trainer.step()
                if transport is None:
                    seconds, nbytes = run_full(url, trainer, work, version)
                    metrics = {}
                else:
                    stats = transport.send(trainer.weights(), version)
                    seconds, nbytes, metrics = stats.seconds, stats.bytes_sent, stats.metrics
                times.append(seconds)
                moved.append(nbytes)
                extra.append(metrics)
                print(
                    f"  {method} update {version}: {seconds:.2f} s, {nbytes / 1e6:.1f} MB {metrics}",
                    flush=True,
                )
        finally:
            if transport is not None:
                transport.close()
        same = engine_digests(url) == {
            k: v for k, v in trainer_digests(trainer).items() if k != "lm_head.weight"
        }
    return {
        "median_s": statistics.median(times),
        "seconds": times,
        "bytes_per_update": statistics.median(moved),
        "bytes": moved,
        "density": [m.get("delta_density") for m in extra] if method.startswith("disk-delta") else None,
        "engine_weights_equal_trainer": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="miles-transports-"))
    model_dir = work / "model"
    t0 = time.perf_counter()
    build_model(model_dir)
    print(f"built the model in {time.perf_counter() - t0:.0f} s", flush=True)
    results = {}
    for method in args.methods:
        print(f"{method}:", flush=True)
        try:
            results[method] = bench_method(method, args, work, model_dir)
        except Exception as exc:  # one method failing (e.g. mooncake missing) must not hide the others
            results[method] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {method} failed: {exc}", flush=True)
    full = results.get("full", {}).get("median_s")
    full_bytes = results.get("full", {}).get("bytes_per_update")
    params = sum(t.numel() for t in Trainer(model_dir, lr=0).master.values())
    summary = {
        m: {
            "median_s": r.get("median_s"),
            "MB_per_update": r["bytes_per_update"] / 1e6 if "bytes_per_update" in r else None,
            "time_vs_full": r["median_s"] / full if full and "median_s" in r else None,
            "bytes_vs_full": r["bytes_per_update"] / full_bytes
            if full_bytes and "bytes_per_update" in r
            else None,
            "equal": r.get("engine_weights_equal_trainer"),
            "error": r.get("error"),
        }
        for m, r in results.items()
    }
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU",
        "command": "uv run --extra p2p python benchmarks/weight_transports.py",
        "model": {
            "params": params,
            "dtype": "bfloat16",
            "shape": "Qwen3, hidden 896, 24 layers, vocab 151936",
        },
        "update": f"AdamW first step, lr {args.lr}, random gradient",
        "updates": args.updates,
        "bucket_mb": args.bucket_mb,
        "summary": summary,
        "results": results,
    }
    path = ROOT / "benchmarks/results/weight_transports.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
