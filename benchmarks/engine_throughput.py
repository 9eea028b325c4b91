"""Embedded engine decode throughput against HF ``generate``, on one GPU, with a random model.

    python benchmarks/engine_throughput.py --shape 0.6b --batches 1,64,256 --prompt 128 --output 256

Builds a random bf16 model of a Qwen3 shape (``0.6b``: hidden 1024, 28 layers, 16/8 heads,
head dim 128, vocab 151,936; ``1.7b``: hidden 2048, 28 layers, 16/8 heads), saves it, and
times, for each batch size, every request sent at once (random prompt ids, sampling at
temperature 1, no stop, exactly ``--output`` new tokens each):

- ``hf``: ``model.generate`` (DynamicCache, ``do_sample``);
- ``dynamic``: the embedded engine on its DynamicCache path (``kv_cache="dynamic"``);
- ``paged``: the embedded engine's paged fast path (``kv_cache="paged"``, CUDA graphs, decode
  step N+1 launched before step N is read);
- ``paged-sync``: the same, reading every decode step before launching the next (``overlap=False``),
  to measure what the overlap gains.

The engines are driven in-process through their scheduler (the same queue ``/generate``
feeds, without HTTP). Reported: output tokens/s over the whole batch, time to first token
(a batch of the same requests with one new token: the time until all have their first),
and the fraction of the bandwidth limit: a decode step must read the weights once plus the
batch's KV (prompt + half the output on average), at ``--bandwidth`` bytes/s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
}


def build_model(shape: str, path: Path) -> tuple[Any, Any]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **SHAPES[shape],
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    return model, config


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


def time_hf(model: Any, prompts: list[list[int]], output: int) -> tuple[float, float]:
    import torch

    ids = torch.tensor(prompts, device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    run(4)  # warm-up
    return run(1), run(output)


def time_engine(engine: Any, prompts: list[list[int]], output: int) -> tuple[float, float]:
    def run(n: int) -> float:
        done = threading.Semaphore(0)
        reqs = []
        for i, p in enumerate(prompts):
            req = engine.make_request(
                input_ids=p, rid=None, max_new_tokens=n, temperature=1.0, top_p=1.0, top_k=-1,
                stop_token_ids=[], seed=i, ignore_eos=True, return_logprob=True, return_routed_experts=False,
            )  # fmt: skip
            req.on_done = lambda r: done.release()
            reqs.append(req)
        t0 = time.perf_counter()
        for r in reqs:
            engine.scheduler.submit(r)
        for _ in reqs:
            assert done.acquire(timeout=1200)
        wall = time.perf_counter() - t0
        bad = [r.finish for r in reqs if len(r.output_ids) != n]
        assert not bad, bad[:3]
        return wall

    def snapshot() -> dict[str, float]:
        return {k: float(v) for k, v in engine.scheduler.stats.items() if isinstance(v, (int, float))}

    run(4)  # warm-up
    ttft = run(1)
    before = snapshot()
    wall = run(output)
    after = snapshot()
    delta = {
        k: after[k] - before[k] for k in ("decode_steps", "decode_s", "prefill_s", "step_s") if k in after
    }
    if delta.get("decode_steps") and "decode_s" in delta:
        steps = delta["decode_steps"]
        print(
            f"  batch {len(prompts)}: {steps:.0f} decode steps, {1e3 * delta['decode_s'] / steps:.2f} ms each "
            f"(forward + read-back), prefill {delta['prefill_s']:.3f}s, steps {delta['step_s']:.3f}s of "
            f"{wall:.3f}s wall",
            flush=True,
        )
    return ttft, wall


def profile_graphs(engine: Any, batches: list[int]) -> None:
    """Device time of one graph replay (the whole decode step, sampling included) and of the sampler
    alone, by CUDA events, on the scratch block (so the KV read is cached: a lower bound)."""
    import torch

    from miles.engines.embedded.paged.sampling import row_keys
    from miles.engines.embedded.paged.triton_kernels import sample_plain

    graphs = engine.paged.graphs
    if graphs is None:
        return
    for b in batches:
        if not graphs.fits(b):
            continue
        packed = [[1] * b, [0] * b, [0] * b, [0] * b, [-1] * b]
        graphs.replay(packed)
        bs = next(s for s in graphs.sizes if s >= b)
        graph = graphs._graphs[bs][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / 20
        logits = torch.randn(b, engine.paged.vocab_size, device="cuda")
        temps = torch.ones(b, device="cuda")
        keys = row_keys(torch.arange(b, device="cuda"), torch.arange(b, device="cuda"))
        sample_plain(logits, temps, keys)
        start.record()
        for _ in range(20):
            sample_plain(logits, temps, keys)
        end.record()
        torch.cuda.synchronize()
        print(
            f"  graph batch {bs}: replay {replay_ms:.3f} ms; sampler alone {start.elapsed_time(end) / 20:.3f} ms",
            flush=True,
        )


def bandwidth_limit(config: Any, weight_bytes: int, batch: int, prompt: int, output: int, bw: float) -> float:
    """Tokens/s if each decode step only read the weights and the batch's KV at ``bw`` bytes/s."""
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    step_bytes = weight_bytes + batch * (prompt + output / 2) * kv_per_token
    return batch / (step_bytes / bw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--paths", default="hf,dynamic,paged")
    ap.add_argument("--dynamic-max-batch", type=int, default=64, help="skip the slow DynamicCache path above")
    ap.add_argument("--hf-max-batch", type=int, default=256)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s (H200 datasheet: 4.8e12)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import torch

    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    batches = [int(b) for b in args.batches.split(",")]
    paths = args.paths.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="engine-bench-"))
    model, config = build_model(args.shape, tmp / "model")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows: list[dict[str, Any]] = []
    info = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "prompt": args.prompt,
        "output": args.output,
        "weight_bytes": weight_bytes,
    }
    print(json.dumps(info), flush=True)

    def record(path: str, batch: int, ttft: float, wall: float) -> None:
        tok_s = batch * args.output / wall
        limit = bandwidth_limit(config, weight_bytes, batch, args.prompt, args.output, args.bandwidth)
        row = dict(path=path, batch=batch, tok_s=tok_s, ttft_s=ttft, wall_s=wall, bw_fraction=tok_s / limit)
        rows.append(row)
        print(json.dumps(row), flush=True)

    if "hf" in paths:
        for b in batches:
            if b <= args.hf_max_batch:
                ttft, wall = time_hf(model, prompts_for(b, args.prompt, config.vocab_size, b), args.output)
                record("hf", b, ttft, wall)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for path in ("dynamic", "paged", "paged-sync"):
        if path not in paths:
            continue
        paged = path.startswith("paged")
        todo = [b for b in batches if paged or b <= args.dynamic_max_batch]
        if not todo:
            continue
        t0 = time.perf_counter()
        options = EngineOptions(
            model_path=str(tmp / "model"),
            device="cuda",
            dtype="bfloat16",
            kv_cache="paged" if paged else path,
            overlap=path != "paged-sync",
            max_batch_size=max(todo),
            prefix_cache_tokens=0,
            mem_fraction=0.85,  # a dedicated engine (the measured figures used this pool size)
        )
        engine = EmbeddedEngine(options)
        engine.start()
        print(f"{path} engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
        try:
            for b in todo:
                ttft, wall = time_engine(
                    engine, prompts_for(b, args.prompt, config.vocab_size, b), args.output
                )
                record(path, b, ttft, wall)
            if path == "paged":
                profile_graphs(engine, todo)
        finally:
            engine.stop()
            del engine
            gc.collect()
            torch.cuda.empty_cache()

    by = {(r["path"], r["batch"]): r for r in rows}
    print(
        f"\n{info['gpu']}, Qwen3-{args.shape} shape (random, bf16), prompt {args.prompt}, output {args.output}"
    )
    print("| batch | path | output tok/s | TTFT (s) | bandwidth-limit fraction | × HF generate |")
    print("| --- | --- | --- | --- | --- | --- |")
    for b in batches:
        for path in ("hf", "dynamic", "paged-sync", "paged"):
            r = by.get((path, b))
            if r is None:
                continue
            hf = by.get(("hf", b))
            ratio = f"{r['tok_s'] / hf['tok_s']:.2f}×" if hf else "n/a"
            print(
                f"| {b} | {path} | {r['tok_s']:,.0f} | {r['ttft_s']:.3f} | {r['bw_fraction']:.1%} | {ratio} |"
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
