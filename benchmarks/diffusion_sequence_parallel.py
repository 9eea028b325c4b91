"""What Ulysses sequence parallelism saves a rank when it re-scores a long video, on CPU (gloo).

    uv run python benchmarks/diffusion_sequence_parallel.py [--degrees 1,2,4] [--frames 33] [--size 128]

A random ``WanTransformer3DModel`` (Wan's architecture at small widths: 2 layers, 4 heads of 32,
patch (1, 2, 2)) re-scores one video latent of ``[16, (frames - 1) / 4 + 1, size / 8, size / 8]``
(the Wan VAE's compression) with a prompt of 32 text tokens, batch 2, as the Flow-GRPO trainer does:
a forward, a loss on the whole (gathered) output, a backward. For each degree ``S``, ``S`` spawned
gloo ranks form one sequence-parallel group (:func:`miles_diffusion.sequence_parallel.
apply_sequence_parallel`, the path ``diffusion.sequence_parallel`` takes), each on ``1/S`` of the
video tokens. Per rank, measured: the bytes the forward saves for the backward (every tensor autograd
keeps but the parameters, counted once per storage through ``torch.autograd.graph.saved_tensors_hooks``: the activation
memory that sequence parallelism exists to cut), the forward + backward wall time (median of
``--repeats`` after a warm-up), and the largest difference of the output and of the summed parameter
gradients from the one-process run (``S = 1``).

Times on the shared 2-core VM are not a speed figure (``S`` ranks share 2 cores, torch one thread
each); the saved bytes do not depend on the machine. Results go to
``benchmarks/results/diffusion_sequence_parallel.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from _bench import RESULTS_DIR, load_avg, machine_info, write_result

HEADS, HEAD_DIM, LAYERS, TEXT_TOKENS, BATCH = 4, 32, 2, 32, 2


def _model() -> Any:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=16,
        out_channels=16,
        text_dim=64,
        freq_dim=64,
        ffn_dim=4 * HEADS * HEAD_DIM,
        num_layers=LAYERS,
        cross_attn_norm=True,
        rope_max_seq_len=1024,
    )


def _inputs(frames: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latent_frames = (frames - 1) // 4 + 1
    x = torch.randn(BATCH, 16, latent_frames, size // 8, size // 8, generator=g)
    t = torch.tensor([700.0, 300.0])
    text = torch.randn(BATCH, TEXT_TOKENS, 64, generator=g)
    return x, t, text


def _saved_bytes(model: Any, inputs: tuple[torch.Tensor, ...]) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves for the backward in one forward (each storage once, the parameters
    themselves left out: they are the same on every rank and not activations), and the output."""
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs, return_dict=False)[0]
    return sum(seen.values()), out


def _measure(model: Any, inputs: tuple[torch.Tensor, ...], repeats: int) -> dict[str, Any]:
    saved, out = _saved_bytes(model, inputs)
    (out.float() ** 2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        (model(*inputs, return_dict=False)[0].float() ** 2).mean().backward()
        times.append(time.perf_counter() - start)
    return {"saved": saved, "out": out.detach(), "grads": grads, "seconds": statistics.median(times[1:])}


def _rank(rank: int, world: int, port: int, frames: int, size: int, repeats: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from miles_diffusion.sequence_parallel import apply_sequence_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
        apply_sequence_parallel(model, mesh)
        result = _measure(model, _inputs(frames, size), repeats)
        for grad in result["grads"].values():  # the group's gradient: the ranks' shares summed
            dist.all_reduce(grad)
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _one_process(frames: int, size: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return _measure(_model(), _inputs(frames, size), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--degrees", default="1,2,4")
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from miles_fsdp.ranks import free_port

    info = machine_info()
    base = _one_process(args.frames, args.size, args.repeats)
    latent_frames = (args.frames - 1) // 4 + 1
    tokens = latent_frames * (args.size // 16) ** 2
    rows: list[dict[str, Any]] = []
    for degree in (int(d) for d in args.degrees.split(",")):
        if degree == 1:
            got = [base]
        else:
            with tempfile.TemporaryDirectory() as tmpdir:
                prefix = os.path.join(tmpdir, "rank")
                tmp.spawn(
                    _rank,
                    args=(degree, free_port(), args.frames, args.size, args.repeats, prefix),
                    nprocs=degree,
                    join=True,
                )
                got = [torch.load(f"{prefix}.{r}") for r in range(degree)]
        out_diff = max(float((g["out"] - base["out"]).abs().max()) for g in got)
        grad_scale = max(float(v.abs().max()) for v in base["grads"].values())
        grad_diff = max(float((got[0]["grads"][n] - v).abs().max()) for n, v in base["grads"].items())
        row = {
            "degree": degree,
            "video_tokens_per_rank": tokens // degree,
            "saved_bytes_per_rank": max(g["saved"] for g in got),
            "saved_vs_one_process": max(g["saved"] for g in got) / base["saved"],
            "fwd_bwd_seconds_median": max(g["seconds"] for g in got),
            "output_max_abs_diff": out_diff,
            "grad_max_abs_diff_over_largest_grad": grad_diff / grad_scale,
        }
        rows.append(row)
        print(row, flush=True)
    result = {
        "machine": info,
        "load_avg_at_end": load_avg(),
        "model": {
            "layers": LAYERS,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "batch": BATCH,
            "text_tokens": TEXT_TOKENS,
        },
        "video": {"frames": args.frames, "size": args.size, "video_tokens": tokens},
        "rows": rows,
    }
    write_result(Path(RESULTS_DIR) / "diffusion_sequence_parallel.json", result)


if __name__ == "__main__":
    main()
