"""The paged KV path on CUDA: Triton kernels against torch, greedy and sampled log-probs against a
plain HF forward in float32, graph replay against eager, a weight update mid-stream, memory
release/resume, and prefix-cache hits against misses. Run on a GPU machine by
``scripts/gpu-tests.sh -k paged``."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.helpers import full_forward_logprobs, generate_in_process, load_local, make_tiny_qwen3

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[7, 3, 9, 1], [5, 6, 2, 8, 11, 4, 4, 9, 13, 2, 1], [100, 3], list(range(20, 57)), [1] * 70]


@pytest.fixture(scope="module")
def model_dir(engine_tmp: Path) -> Path:
    # 16 query heads over 4 KV heads (GQA groups of 4), head_dim 32: the kernel's real shapes in small.
    return make_tiny_qwen3(
        engine_tmp / "paged-gpu",
        seed=4,
        hidden_size=64,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=32,
    )


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
    """Submit every prompt at once; wait for all answers."""
    return generate_in_process(engine, prompts, **{"max_new_tokens": 24, "timeout": 300, **params})


def test_triton_kernels_match_torch() -> None:
    from miles.engines.embedded.paged.model import gather_meta
    from miles.engines.embedded.paged.sampling import SamplingTensors, row_keys, sample_torch
    from miles.engines.embedded.paged.triton_kernels import paged_decode, sample_plain

    torch.manual_seed(0)
    page, heads, kvh, dim = 16, 16, 8, 128
    lens = [1, 17, 300, 64, 129]
    blocks = [list(range(1 + 20 * i, 1 + 20 * i + -(-n // page))) for i, n in enumerate(lens)]
    k = torch.randn(120 * page, kvh, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), heads, dim, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(8, 20, dtype=torch.int32, device="cuda")
    rows = torch.tensor([3, 1, 7, 2, 5], dtype=torch.int32, device="cuda")
    for r, b in zip(rows.tolist(), blocks, strict=True):
        table[r, : len(b)] = torch.tensor(b, dtype=torch.int32)
    out = paged_decode(
        q, k, v, table, rows, torch.tensor(lens, dtype=torch.int32, device="cuda"), dim**-0.5, page
    )
    meta = gather_meta([1] * len(lens), lens, blocks, page, "cuda")
    kp = k[meta.kv_slots].transpose(1, 2).repeat_interleave(2, 1).float()
    vp = v[meta.kv_slots].transpose(1, 2).repeat_interleave(2, 1).float()
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].float(), kp, vp, attn_mask=meta.mask)
    err = (out.float() - ref[:, :, 0]).norm() / ref.norm()
    assert err < 1e-2, err
    logits = torch.randn(64, 151936, device="cuda") * 4
    st = SamplingTensors(
        temperature=torch.rand(64, device="cuda") + (torch.arange(64, device="cuda") % 4 != 0),
        top_p=torch.ones(64, device="cuda"),
        top_k=torch.full((64,), 151936, device="cuda"),
        seeds=torch.arange(64, device="cuda") * 31,
        positions=torch.arange(64, device="cuda") + 100,
        filtered=False,
    )
    st.temperature[::4] = 0.0  # greedy rows
    t1, l1 = sample_torch(logits, st)
    t2, l2 = sample_plain(logits, st.temperature, row_keys(st.seeds, st.positions))
    assert torch.equal(t1, t2)
    assert torch.allclose(l1, l2, atol=1e-4)


def test_paged_equals_hf_forward_in_float32(model_dir: Path) -> None:
    engine = _engine(model_dir)
    try:
        assert engine.paged.graphs is not None
        # The runner reads the HF model's own parameter tensors (no copies).
        layer = engine.paged.model.layers[0].self_attn.q_proj.weight
        assert layer.data_ptr() == engine.model.model.layers[0].self_attn.q_proj.weight.data_ptr()
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
    finally:
        engine.stop()


def test_graph_replay_equals_eager(model_dir: Path) -> None:
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
    finally:
        graphs.stop()
        eager.stop()


def test_overlapped_decoding_equals_reading_every_step_on_cuda(model_dir: Path) -> None:
    overlapped = _engine(model_dir)
    plain = _engine(model_dir, overlap=False)
    try:
        [free] = _generate(plain, PROMPTS[:1], temperature=0.9, seed=4)
        per_prompt = [
            {"stop_token_ids": [free.output_ids[6]]},
            {"max_new_tokens": 5},
            {},
            {},
            {"temperature": 0.0},
        ]
        for params in (dict(temperature=0.9, seed=4), dict(temperature=1.0, top_k=5, top_p=0.9, seed=1)):
            a = _generate(overlapped, PROMPTS, per_prompt=per_prompt, **params)
            b = _generate(plain, PROMPTS, per_prompt=per_prompt, **params)
            for x, y in zip(a, b, strict=True):
                assert x.finish == y.finish
                assert x.output_ids == y.output_ids
                assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=1e-5)
        assert overlapped.scheduler.stats["overlapped_steps"] > 0
        assert plain.scheduler.stats["overlapped_steps"] == 0
    finally:
        overlapped.stop()
        plain.stop()


def test_weight_update_lands_between_steps(model_dir: Path, engine_tmp: Path) -> None:
    engine = _engine(model_dir)
    other = load_local(
        make_tiny_qwen3(
            engine_tmp / "paged-gpu-5",
            seed=5,
            hidden_size=64,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=32,
        )
    )
    tensors = {k: v.detach().contiguous() for k, v in other.named_parameters()}
    try:
        results: list[Any] = []
        worker = threading.Thread(
            target=lambda: results.extend(_generate(engine, [PROMPTS[1]], max_new_tokens=400))
        )
        worker.start()
        while engine.scheduler.stats["decode_steps"] < 20:
            time.sleep(0.001)
        engine.weights.update(lambda: tensors, "7")
        worker.join(timeout=300)
        [r] = results
        versions = r.output_versions
        assert versions[0] == 0 and versions[-1] == 7 and sorted(versions) == versions
        # After the update a fresh request is the new model's, through the captured graphs.
        local = other.cuda()
        [fresh] = _generate(engine, [PROMPTS[0]], temperature=0.8, seed=3)
        assert fresh.output_versions == [7] * 24
        expected = full_forward_logprobs(local, PROMPTS[0], fresh.output_ids, 0.8)
        assert fresh.output_logprobs == pytest.approx(expected, abs=2e-4)
    finally:
        engine.stop()


def test_release_and_resume_free_and_restore_memory(model_dir: Path) -> None:
    engine = _engine(model_dir, kv_tokens=0, mem_fraction=0.05)  # sized from free memory
    try:
        before = _generate(engine, PROMPTS, temperature=0.6, seed=2)
        torch.cuda.synchronize()
        held = engine.paged.pool.nbytes
        allocated = torch.cuda.memory_allocated()
        free_before = torch.cuda.mem_get_info()[0]
        freed = engine.release_memory()
        torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info()[0]
        print(
            f"KV pool {held} bytes; allocated {allocated} -> {torch.cuda.memory_allocated()}; "
            f"device free {free_before} -> {free_after} (+{free_after - free_before})"
        )
        assert freed == held > 0
        assert allocated - torch.cuda.memory_allocated() >= held
        assert free_after - free_before >= 0.9 * held
        released = torch.cuda.memory_allocated()
        engine.resume_memory()
        assert torch.cuda.memory_allocated() - released >= held  # the pool is back
        after = _generate(engine, PROMPTS, temperature=0.6, seed=2)  # graphs kept or captured again
        for x, y in zip(before, after, strict=True):
            assert x.output_ids == y.output_ids
        # Again with a tensor holding part of the freed memory while the pool comes back: the pool may
        # land at other addresses, and the graphs must then be captured again (both ways answer alike).
        addresses = engine.paged.pool.addresses()
        engine.release_memory()
        blocker = torch.empty(held // 2, dtype=torch.uint8, device="cuda")
        engine.resume_memory()
        moved = engine.paged.pool.addresses() != addresses
        print(f"pool came back {'elsewhere (graphs captured again)' if moved else 'in place (graphs kept)'}")
        del blocker
        again = _generate(engine, PROMPTS, temperature=0.6, seed=2)
        for x, y in zip(before, again, strict=True):
            assert x.output_ids == y.output_ids
    finally:
        engine.stop()


def test_prefix_hit_equals_miss_through_the_graphs(model_dir: Path) -> None:
    """A conversation's later turns take their history's blocks from the radix cache; every decode runs
    through the CUDA graphs on those shared blocks, and answers as an engine without the cache does."""
    on = _engine(model_dir)
    off = _engine(model_dir, prefix_cache_tokens=0)
    try:
        assert on.paged.graphs is not None and on.scheduler.radix is not None
        assert off.scheduler.radix is None
        block = on.paged.allocator.block_size
        rng = random.Random(0)
        n = 24
        for temperature in (0.0, 0.7):
            system = [rng.randrange(128) for _ in range(40)]  # shared by every session: 2 full blocks
            sessions = [system + [rng.randrange(128) for _ in range(5 + 7 * i)] for i in range(3)]
            expected = [0, 2 * block, 2 * block]  # the later sessions find the first one's system blocks
            for turn in range(4):
                # The first session runs alone in the first turn, so the others find its system blocks.
                got = _generate(on, sessions[:1], temperature=temperature, seed=6) if turn == 0 else []
                got += _generate(on, sessions[len(got) :], temperature=temperature, seed=6)
                want = _generate(off, sessions, temperature=temperature, seed=6)
                for g, w, cached in zip(got, want, expected, strict=True):
                    assert g.cached_tokens == cached
                    assert g.output_ids == w.output_ids
                    assert g.output_logprobs == pytest.approx(w.output_logprobs, abs=1e-4)
                # Each turn consumed its prompt and all but its last output: those complete blocks are cached.
                expected = [(len(s) + n - 1) // block * block for s in sessions]
                sessions = [
                    s + g.output_ids + [rng.randrange(128) for _ in range(3)]
                    for s, g in zip(sessions, got, strict=True)
                ]
        assert on.scheduler.stats["prefix_cache_hits"] >= 2 * (2 + 3 * 3)
        alloc = on.paged.allocator
        with on.scheduler.step_lock:
            alloc.check()
            on.scheduler.flush_prefix_cache()
            assert alloc.num_free == alloc.num_blocks - 1
    finally:
        on.stop()
        off.stop()
