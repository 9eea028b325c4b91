"""Qwen3-MoE on the paged KV path on CUDA: the sync-free sparse block against the HF block (float32 and
bfloat16, eagerly and replayed from a CUDA graph), and the paged engine through CUDA graphs against a
plain HF forward (greedy tokens, log-probs and routed experts in float32; a bfloat16 run; a weight
update mid-stream). Run on a GPU machine by ``scripts/gpu-tests.sh -k paged``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.helpers import VOCAB, full_forward_logprobs, generate_in_process, hf_routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[7, 3, 9, 1], [5, 6, 2, 8, 11, 4, 4, 9, 13, 2, 1], [100, 3], list(range(20, 57)), [1] * 70]


def _config(**overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig

    # head_dim 32 and GQA groups of 4 (the decode kernel's shapes in small); expert sizes multiples
    # of 8 (bf16 grouped GEMMs need 16-byte rows); a dense layer between two sparse ones.
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=16,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=512, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1],
    )  # fmt: skip
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


def _save(path: Path, seed: int) -> Path:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(engine_tmp: Path) -> Path:
    return _save(engine_tmp / "paged-moe-gpu", seed=4)


def _engine(model_dir: Path, **options: Any) -> Any:
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    opts: dict[str, Any] = dict(
        device="cuda", dtype="float32", kv_cache="paged", kv_tokens=8192, max_batch_size=16
    )
    opts.update(options)
    engine = EmbeddedEngine(EngineOptions(model_path=str(model_dir), **opts))
    engine.start()
    return engine


def _generate(engine: Any, prompts: list[list[int]], **params: Any) -> list[Any]:
    params = {"max_new_tokens": 24, "timeout": 300, "return_routed_experts": True, **params}
    return generate_in_process(engine, prompts, **params)


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of (token, layer) entries whose chosen experts are the same set."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.sort(-1).values == b.sort(-1).values).all(-1).float().mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_free_moe_equals_the_hf_block(dtype: torch.dtype) -> None:
    from transformers import Qwen3MoeForCausalLM

    from miles.engines.embedded.paged.moe import experts_dense, grouped_mm_reason, moe_fused, route

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config()).to("cuda", dtype).eval()
    mlp = model.model.layers[0].mlp
    experts = mlp.experts
    hidden, inter = experts.down_proj.shape[1:]
    reason = grouped_mm_reason(dtype, torch.device("cuda"), hidden, inter)
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] in (9, 10):
        assert reason is None  # Hopper / Blackwell: the grouped GEMM kernel runs, sync-free
    grouped = reason is None
    expert_range = torch.arange(experts.num_experts, device="cuda")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        for tokens in (1, 5, 300):
            h = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            block = mlp(h[None])[0]
            _, _, hf_ids = mlp.gate(h)
            ids = torch.full((tokens, 4), -1, dtype=torch.long, device="cuda")
            out = moe_fused(mlp, h, ids, grouped, expert_range)  # eager: grouped, or the HF experts
            assert torch.equal(ids, hf_ids)
            torch.testing.assert_close(out, block, **tol)
            weights = route(h, mlp.gate, ids)
            torch.testing.assert_close(experts_dense(h, ids, weights, experts), block, **tol)
        # Captured in a CUDA graph (what a decode step does), replayed on new inputs.
        static_h = torch.randn(16, hidden, device="cuda", dtype=dtype)
        static_ids = torch.zeros(16, 4, dtype=torch.long, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe_fused(mlp, static_h, static_ids, grouped, expert_range)  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe_fused(mlp, static_h, static_ids, grouped, expert_range)
        for _ in range(3):
            static_h.copy_(torch.randn_like(static_h))
            graph.replay()
            block = mlp(static_h[None])[0]
            assert torch.equal(static_ids, mlp.gate(static_h)[2])
            torch.testing.assert_close(static_out, block, **tol)


def test_paged_moe_equals_hf_forward_in_float32(model_dir: Path) -> None:
    from engine.helpers import load_local

    engine = _engine(model_dir)
    auto = _engine(model_dir, kv_cache="auto")
    try:
        assert auto.server_info()["kv_cache"] == "paged"  # auto takes Qwen3-MoE on CUDA
        paged = engine.paged
        assert paged.graphs is not None and paged.graphs.routed is not None
        assert paged.model.num_sparse == 2 and not paged.model.grouped  # float32: dense inside graphs
        # The runner reads the HF model's own expert tensors (no copies).
        ours = paged.model.layers[0].mlp.experts.gate_up_proj
        assert ours.data_ptr() == engine.model.model.layers[0].mlp.experts.gate_up_proj.data_ptr()
        local = load_local(model_dir).cuda()
        for temperature in (0.0, 0.7):
            reqs = _generate(engine, PROMPTS, temperature=temperature, seed=9)
            for r, prompt in zip(reqs, PROMPTS, strict=True):
                if temperature == 0.0:
                    ids = list(prompt)
                    with torch.no_grad():
                        for _ in range(24):
                            ids.append(int(local(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
                    assert r.output_ids == ids[len(prompt) :]
                expected = full_forward_logprobs(local, prompt, r.output_ids, temperature)
                assert r.output_logprobs == pytest.approx(expected, abs=2e-4)
                routed = torch.cat(r.routed)
                assert routed.shape == (len(prompt) + 23, 2, 4)
                assert _same_sets(routed, hf_routing(local, prompt + r.output_ids[:-1])) >= 0.99
        # Rows that do not ask get nothing; the others keep their routing in the same batch.
        mixed = _generate(
            engine, PROMPTS[:2], per_prompt=[{"return_routed_experts": False}, {}], temperature=0.0
        )
        assert mixed[0].routed == [] and mixed[1].num_routed == len(PROMPTS[1]) + 23
    finally:
        engine.stop()
        auto.stop()


def test_graph_replay_equals_eager_with_routing(model_dir: Path) -> None:
    graphs = _engine(model_dir)
    eager = _engine(model_dir, cuda_graphs=False)
    try:
        assert eager.paged.graphs is None
        for params in (dict(temperature=0.9, seed=4), dict(temperature=1.0, top_k=5, top_p=0.9, seed=1)):
            a = _generate(graphs, PROMPTS, **params)
            b = _generate(eager, PROMPTS, **params)
            for x, y in zip(a, b, strict=True):
                assert x.output_ids == y.output_ids
                assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=1e-5)
                assert _same_sets(torch.cat(x.routed), torch.cat(y.routed)) >= 0.99
    finally:
        graphs.stop()
        eager.stop()


def test_paged_moe_in_bfloat16(model_dir: Path) -> None:
    """bfloat16 through CUDA graphs (grouped GEMMs on Hopper/Blackwell): the engine's log-probs and
    routing of its own tokens agree with one bfloat16 HF forward over them."""
    from transformers import AutoModelForCausalLM

    engine = _engine(model_dir, dtype="bfloat16")
    try:
        assert engine.paged.graphs is not None
        if torch.cuda.get_device_capability()[0] in (9, 10):
            assert engine.paged.model.grouped
        reqs = _generate(engine, PROMPTS, temperature=1.0, seed=2)
    finally:
        engine.stop()
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    diffs: list[float] = []
    for r, prompt in zip(reqs, PROMPTS, strict=True):
        expected = full_forward_logprobs(local, prompt, r.output_ids, 1.0)
        diffs += [abs(a - b) for a, b in zip(r.output_logprobs, expected, strict=True)]
        assert _same_sets(torch.cat(r.routed), hf_routing(local, prompt + r.output_ids[:-1])) >= 0.9
    assert sum(diffs) / len(diffs) < 0.1 and max(diffs) < 1.0, (sum(diffs) / len(diffs), max(diffs))


def test_weight_update_lands_in_the_experts_between_steps(model_dir: Path, engine_tmp: Path) -> None:
    from engine.helpers import load_local

    engine = _engine(model_dir)
    other = load_local(_save(engine_tmp / "paged-moe-gpu-5", seed=5))
    tensors = {k: v.detach().contiguous() for k, v in other.named_parameters()}
    try:
        results: list[Any] = []
        worker = threading.Thread(
            target=lambda: results.extend(_generate(engine, [PROMPTS[1]], max_new_tokens=300))
        )
        worker.start()
        while engine.scheduler.stats["decode_steps"] < 20:
            time.sleep(0.001)
        engine.weights.update(lambda: tensors, "7")
        worker.join(timeout=300)
        [r] = results
        assert r.output_versions[0] == 0 and r.output_versions[-1] == 7
        assert r.num_routed == len(PROMPTS[1]) + 299
        # After the update a fresh request is the new model's (experts and routers), through the graphs.
        local = other.cuda()
        [fresh] = _generate(engine, [PROMPTS[0]], temperature=0.8, seed=3)
        assert fresh.output_versions == [7] * 24
        expected = full_forward_logprobs(local, PROMPTS[0], fresh.output_ids, 0.8)
        assert fresh.output_logprobs == pytest.approx(expected, abs=2e-4)
        routed = torch.cat(fresh.routed)
        assert _same_sets(routed, hf_routing(local, PROMPTS[0] + fresh.output_ids[:-1])) >= 0.99
    finally:
        engine.stop()
