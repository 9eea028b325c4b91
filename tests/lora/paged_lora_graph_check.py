"""Run by test_paged_lora.py in a subprocess with TRITON_INTERPRET=1: the CUDA path's decode step with
LoRA adapter rows, on the CPU. The engine's decode goes through ``DecodeGraphs._body`` (what a CUDA
graph captures: slots read from ``lora_rows`` by table row, the fused Triton layer kernels, the paged
decode kernel, the sampling kernel; all interpreted) run eagerly instead of captured, and must give
what the CPU modules path gives. Usage: ``python paged_lora_graph_check.py <work dir>``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

PROMPTS = [[7, 3, 9, 1], [5, 6, 2, 8, 11, 4, 4, 9, 13, 2, 1], [100, 3], list(range(20, 41))]
ADAPTER_OF = ["a", "b", None, "c"]


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{name}: {'ok' if ok else 'MISMATCH'} {detail}")
    if not ok:
        raise SystemExit(1)


def _engine(base: Path, adapters: dict[str, Path]) -> Any:
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    engine = EmbeddedEngine(
        EngineOptions(
            model_path=str(base),
            device="cpu",
            dtype="float32",
            kv_cache="paged",
            kv_tokens=512,
            max_batch_size=8,
            max_loras=3,
            max_lora_rank=8,
        )
    )
    for name, path in adapters.items():
        engine.load_lora_adapter(name, str(path))
    return engine


def _graph_body_engine(base: Path, adapters: dict[str, Path]) -> tuple[Any, list[int]]:
    """An engine whose decode steps run the graph body eagerly, with the fused (Triton) layers."""
    from miles.engines.embedded.paged.graphs import DecodeGraphs

    engine = _engine(base, adapters)
    runner = engine.paged
    runner.model.fused = True
    graphs = DecodeGraphs(runner, 8)
    calls = [0]

    def replay(packed: list[list[int]]) -> tuple[Any, Any, Any]:
        calls[0] += 1
        n = len(packed[0])
        bs = next(s for s in graphs.sizes if s >= n)
        host = torch.zeros(5, bs, dtype=torch.long)
        host[4] = -1
        host[:, :n] = torch.tensor(packed, dtype=torch.long)
        graphs.buffer[:, :bs].copy_(host)
        with torch.inference_mode():
            logits, tokens, logprobs = graphs._body(bs)
        return logits[:n], tokens[:n], logprobs[:n]

    graphs.replay = replay  # type: ignore[method-assign]
    runner.graphs = graphs
    return engine, calls


def main() -> None:
    from engine.helpers import generate_in_process, make_tiny_qwen3

    from lora.helpers import forward_logprobs, make_adapter, merged_model

    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    # The CUDA kernels' shapes: head_dim a power of two >= 16, GQA groups of 4.
    base = make_tiny_qwen3(
        root / "base",
        seed=4,
        hidden_size=64,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=False,
    )
    adapters = {
        "a": make_adapter(base, root / "a", seed=1, rank=8, targets=["q_proj", "v_proj", "down_proj"]),
        "b": make_adapter(base, root / "b", seed=2, rank=4, targets=["o_proj", "gate_proj"]),
        "c": make_adapter(base, root / "c", seed=3, rank=2, targets=["k_proj", "up_proj", "lm_head"]),
    }
    per_prompt = [{"lora": name} for name in ADAPTER_OF]
    results = []
    for make in (lambda: (_engine(base, adapters), [0]), lambda: _graph_body_engine(base, adapters)):
        engine, calls = make()
        engine.start()
        try:
            results.append(
                generate_in_process(
                    engine, PROMPTS, max_new_tokens=5, timeout=600, per_prompt=per_prompt, temperature=0.0
                )
            )
        finally:
            engine.stop()
    check("graph body ran", calls[0] > 0, f"{calls[0]} decode steps")
    for name, prompt, want, got in zip(ADAPTER_OF, PROMPTS, *results, strict=True):
        err = max(abs(x - y) for x, y in zip(want.output_logprobs, got.output_logprobs, strict=True))
        check(f"row {name}: tokens", got.output_ids == want.output_ids)
        check(f"row {name}: log-probs", err < 1e-5, f"max err {err:.2e}")
        ref = forward_logprobs(merged_model(base, adapters[name] if name else None), prompt, got.output_ids)
        err = max(abs(x - y) for x, y in zip(ref, got.output_logprobs, strict=True))
        check(f"row {name}: merged model", err < 1e-4, f"max err {err:.2e}")


if __name__ == "__main__":
    main()
