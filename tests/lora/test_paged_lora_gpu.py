"""LoRA on the paged path on CUDA (skipped without it; ``scripts/gpu-tests.sh -k paged_lora``): adapter
rows through the decode CUDA graphs equal eager steps and the merged model in float32; loading an
adapter into a free slot captures nothing again; an adapter update lands in the captured graphs."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine.helpers import generate_in_process, make_tiny_qwen3

from lora.helpers import forward_logprobs, make_adapter, merged_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[7, 3, 9, 1], [5, 6, 2, 8, 11, 4, 4, 9, 13, 2, 1], [100, 3], list(range(20, 57)), [1] * 70]
ADAPTER_OF = ["a", "b", None, "a", "b"]


@pytest.fixture(scope="module")
def gpu_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The shapes the CUDA decode kernel needs (head_dim a power of two >= 16), GQA groups of 4.
    return make_tiny_qwen3(
        tmp_path_factory.mktemp("lora-gpu-base"),
        seed=4,
        hidden_size=64,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def gpu_adapters(gpu_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-gpu-adapters")
    return {
        "a": make_adapter(gpu_base, root / "a", seed=1, rank=8, targets=["q_proj", "v_proj", "down_proj"]),
        "b": make_adapter(gpu_base, root / "b", seed=2, rank=4, targets=["o_proj", "gate_proj", "lm_head"]),
        # a's modules, other factors: loads into a free slot without allocating stacks.
        "a2": make_adapter(gpu_base, root / "a2", seed=9, rank=8, targets=["q_proj", "v_proj", "down_proj"]),
    }


def _engine(base: Path, **options: Any) -> Any:
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    opts: dict[str, Any] = dict(
        device="cuda",
        dtype="float32",
        kv_cache="paged",
        kv_tokens=8192,
        max_batch_size=16,
        max_loras=3,
        max_lora_rank=8,
    )
    opts.update(options)
    engine = EmbeddedEngine(EngineOptions(model_path=str(base), **opts))
    engine.start()
    return engine


def _generate(engine: Any, **params: Any) -> list[Any]:
    per_prompt = [{"lora": name} for name in ADAPTER_OF]
    return generate_in_process(
        engine, PROMPTS, **{"max_new_tokens": 24, "timeout": 300, "per_prompt": per_prompt, **params}
    )


def _same_graphs(engine: Any, captured: dict[int, Any]) -> bool:
    """Whether the engine replays exactly the graph objects of ``captured`` (nothing recaptured)."""
    now = engine.paged.graphs._graphs
    return set(now) == set(captured) and all(now[bs][0] is captured[bs][0] for bs in captured)


def _count_replays(engine: Any) -> list[int]:
    graphs = engine.paged.graphs
    count = [0]
    replay = graphs.replay

    def counting(packed: list[list[int]]) -> Any:
        count[0] += 1
        return replay(packed)

    graphs.replay = counting
    return count


def test_adapter_rows_through_cuda_graphs_equal_eager_and_the_merged_model(gpu_base, gpu_adapters):
    graphs = _engine(gpu_base)
    eager = _engine(gpu_base, cuda_graphs=False)
    try:
        for engine in (graphs, eager):
            engine.load_lora_adapter("a", str(gpu_adapters["a"]))
            engine.load_lora_adapter("b", str(gpu_adapters["b"]))
        assert graphs.paged.graphs is not None and eager.paged.graphs is None
        replays = _count_replays(graphs)
        merged = {n: merged_model(gpu_base, gpu_adapters[n] if n else None) for n in ("a", "b", None)}
        for params in (dict(temperature=0.0), dict(temperature=0.9, seed=4)):
            x = _generate(graphs, **params)
            y = _generate(eager, **params)
            for prompt, name, g, e in zip(PROMPTS, ADAPTER_OF, x, y, strict=True):
                assert g.output_ids == e.output_ids
                assert g.output_logprobs == pytest.approx(e.output_logprobs, abs=1e-5)
                if params["temperature"] == 0.0:
                    want = forward_logprobs(merged[name], prompt, g.output_ids)
                    assert g.output_logprobs == pytest.approx(want, abs=2e-4)
        assert replays[0] > 0  # the decode steps ran in the graphs
        assert graphs.scheduler.stats["max_decode_batch"] == len(PROMPTS)  # adapters mixed in one graph
    finally:
        graphs.stop()
        eager.stop()


def test_a_free_slot_needs_no_recapture_and_updates_land_in_the_graphs(gpu_base, gpu_adapters):
    from safetensors.torch import load_file

    from miles.engines.embedded.lora import PEFT_PREFIX, tensor_name

    engine = _engine(gpu_base)
    try:
        engine.load_lora_adapter("a", str(gpu_adapters["a"]))  # allocates stacks: graphs captured again
        captured = dict(engine.paged.graphs._graphs)
        assert captured
        engine.load_lora_adapter("a2", str(gpu_adapters["a2"]))  # same modules, a free slot
        assert _same_graphs(engine, captured)  # the same graph objects: nothing recaptured
        # Adapter a's factors replaced by a2's through a weight update, mid-stream, into the slot.
        raw = load_file(str(gpu_adapters["a2"] / "adapter_model.safetensors"))
        tensors = {
            tensor_name(
                k.removeprefix(PEFT_PREFIX).split(".lora_")[0], "A" if ".lora_A" in k else "B", "a"
            ): v
            for k, v in raw.items()
        }
        results: list[Any] = []
        worker = threading.Thread(
            target=lambda: results.extend(
                generate_in_process(
                    engine, [PROMPTS[1]], max_new_tokens=300, timeout=300, per_prompt=[{"lora": "a"}]
                )
            )
        )
        worker.start()
        while engine.scheduler.stats["decode_steps"] < 20:
            time.sleep(0.001)
        engine.weights.update(lambda: tensors, "5")
        worker.join(timeout=300)
        [r] = results
        assert r.output_versions[0] == 0 and r.output_versions[-1] == 5
        assert _same_graphs(engine, captured)
        replays = _count_replays(engine)
        jobs = generate_in_process(
            engine,
            [PROMPTS[0], PROMPTS[0], PROMPTS[0]],
            max_new_tokens=24,
            timeout=300,
            per_prompt=[{"lora": "a"}, {"lora": "a2"}, {"lora": None}],
        )
        assert replays[0] > 0
        new = merged_model(gpu_base, gpu_adapters["a2"])
        for row in jobs[:2]:  # a (updated to a2's factors) and a2 itself
            assert row.output_logprobs == pytest.approx(
                forward_logprobs(new, PROMPTS[0], row.output_ids), abs=2e-4
            )
        base = forward_logprobs(merged_model(gpu_base, None), PROMPTS[0], jobs[2].output_ids)
        assert jobs[2].output_logprobs == pytest.approx(base, abs=2e-4)
        # The last adapter's unload frees the stacks; the graphs are captured again without LoRA.
        engine.unload_lora_adapter("a")
        engine.unload_lora_adapter("a2")
        assert not engine.lora.stacks and not _same_graphs(engine, captured)
        [plain] = generate_in_process(engine, [PROMPTS[0]], max_new_tokens=24, timeout=300)
        assert plain.output_ids == jobs[2].output_ids
    finally:
        engine.stop()
