"""The paged KV path on the CPU: allocator accounting, sampling, and the paged engine against the
DynamicCache engine on a tiny Qwen3 (chunked prefill, preemption, pause, memory release)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.helpers import (
    full_forward_logprobs,
    generate_in_process,
    greedy_request,
    load_local,
    make_tiny_qwen3,
)
from miles.engines.embedded.paged.allocator import BlockAllocator, OutOfBlocks
from miles.engines.embedded.paged.sampling import SamplingTensors, sample_torch

PROMPTS = [[7, 3, 9, 1], [5, 6, 2, 8, 11, 4, 4, 9, 13, 2, 1], [100, 3], list(range(20, 57))]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- allocator


def test_allocator_accounting() -> None:
    a = BlockAllocator(9, 4)
    assert a.num_free == 8 and a.capacity_tokens == 32 and a.blocks_for(9) == 3
    x = a.allocate(3)
    y = a.allocate(5)
    assert 0 not in x + y and len(set(x + y)) == 8 and a.num_free == 0
    with pytest.raises(OutOfBlocks):
        a.allocate(1)
    a.share(x[:2])  # a second holder of a shared prefix
    a.release(x)
    assert a.num_free == 1 and a.refcount(x[0]) == 1
    a.release(x[:2])
    a.release(y)
    assert a.num_free == 8
    a.check()
    with pytest.raises(ValueError, match="double free"):
        a.release([x[0]])
    with pytest.raises(ValueError, match="not allocated"):
        a.share([x[0]])


# ----------------------------------------------------------------- sampling


def _st(n: int, vocab: int, **kw: Any) -> SamplingTensors:
    base: dict[str, Any] = dict(
        temperature=torch.ones(n),
        top_p=torch.ones(n),
        top_k=torch.full((n,), vocab),
        seeds=torch.arange(n) * 7919 + 1,
        positions=torch.full((n,), 5),
        filtered=False,
    )
    base.update(kw)
    return SamplingTensors(**base)


def test_sampling_is_a_function_of_seed_and_position() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 2
    a, lp_a = sample_torch(logits, _st(6, 50))
    b, _ = sample_torch(logits, _st(6, 50))
    c, _ = sample_torch(logits, _st(6, 50, positions=torch.full((6,), 6)))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.allclose(lp_a, torch.log_softmax(logits, -1).gather(1, a[:, None]).squeeze(1))
    greedy, lp_g = sample_torch(logits, _st(6, 50, temperature=torch.zeros(6)))
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.allclose(lp_g, torch.log_softmax(logits, -1).max(-1).values)


def test_sampling_frequencies_and_truncation() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[None].repeat(4000, 1)
    n = logits.shape[0]
    tokens, _ = sample_torch(logits, _st(n, 4, seeds=torch.arange(n)))
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    top2, lp = sample_torch(
        logits, _st(n, 4, seeds=torch.arange(n), top_k=torch.full((n,), 2), filtered=True)
    )
    assert set(top2.tolist()) == {0, 1}
    # The log-prob is the full-vocabulary one, not the truncated distribution's.
    assert torch.allclose(lp, torch.log(torch.tensor([0.5, 0.3]))[top2])
    nucleus, _ = sample_torch(
        logits, _st(n, 4, seeds=torch.arange(n), top_p=torch.full((n,), 0.7), filtered=True)
    )
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 < 0.7, then 0.8 >= 0.7: the third is dropped


# ------------------------------------------------------------ the engines


@pytest.fixture(scope="module")
def model_dir(engine_tmp: Path) -> Path:
    return make_tiny_qwen3(engine_tmp / "paged-model", seed=3)


def _engine(model_dir: Path, **options: Any) -> Any:
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    engine = EmbeddedEngine(
        EngineOptions(model_path=str(model_dir), device="cpu", dtype="float32", **options)
    )
    engine.start()
    return engine


def _generate(engine: Any, prompts: list[list[int]], **params: Any) -> list[Any]:
    """Submit every prompt at once; wait for all answers."""
    return generate_in_process(engine, prompts, **{"max_new_tokens": 12, "timeout": 120, **params})


def _paged(model_dir: Path, **options: Any) -> Any:
    return _engine(model_dir, kv_cache="paged", kv_tokens=options.pop("kv_tokens", 512), **options)


def _assert_all_free(engine: Any) -> None:
    """Nothing runs: once the prefix cache lets go of its blocks, every block is free."""
    alloc = engine.paged.allocator
    with engine.scheduler.step_lock:
        alloc.check()
        engine.scheduler.flush_prefix_cache()
        assert alloc.num_free == alloc.num_blocks - 1


def test_paged_greedy_equals_dynamic_and_full_forward(model_dir: Path) -> None:
    dynamic = _engine(model_dir, kv_cache="dynamic")
    paged = _paged(model_dir, chunk_tokens=7, block_size=4)  # prompts cut in chunks of 7
    try:
        assert paged.server_info()["kv_cache"] == "paged"
        a = _generate(dynamic, PROMPTS)
        b = _generate(paged, PROMPTS)
        local = load_local(model_dir)
        for x, y, prompt in zip(a, b, PROMPTS, strict=True):
            assert y.finish == {"type": "length", "length": 12}
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-5)
            assert y.output_logprobs == pytest.approx(
                full_forward_logprobs(local, prompt, y.output_ids, 0.0), abs=1e-5
            )
        assert paged.scheduler.stats["prefill_chunks"] > len(PROMPTS)  # the long prompt took several
        _assert_all_free(paged)
    finally:
        dynamic.stop()
        paged.stop()


def test_paged_sampled_logprobs_match_a_full_forward(model_dir: Path) -> None:
    paged = _paged(model_dir)
    try:
        reqs = _generate(paged, PROMPTS, temperature=0.8, seed=11, max_new_tokens=10)
        again = _generate(paged, PROMPTS, temperature=0.8, seed=11, max_new_tokens=10)
        local = load_local(model_dir)
        for r, s, prompt in zip(reqs, again, PROMPTS, strict=True):
            assert r.output_ids == s.output_ids  # seeded: the same draws
            expected = full_forward_logprobs(local, prompt, r.output_ids, 0.8)
            assert r.output_logprobs == pytest.approx(expected, abs=1e-5)
        filtered = _generate(paged, PROMPTS, temperature=1.0, top_k=3, top_p=0.9, seed=2, max_new_tokens=6)
        assert all(len(r.output_ids) == 6 for r in filtered)
    finally:
        paged.stop()


def test_preemption_keeps_tokens_and_logprobs(model_dir: Path) -> None:
    prompts = [list(range(10 + i, 22 + i)) for i in range(6)]  # 12 tokens each, 6 at once
    roomy = _paged(model_dir, kv_tokens=1024, block_size=4)
    # 64 slots: each request needs up to 12 + 24 = 36, so decodes run out of blocks and retract.
    tight = _paged(model_dir, kv_tokens=64, block_size=4)
    try:
        a = _generate(roomy, prompts, max_new_tokens=24, temperature=0.9, seed=5)
        b = _generate(tight, prompts, max_new_tokens=24, temperature=0.9, seed=5)
        assert tight.scheduler.stats["retractions"] > 0
        assert roomy.scheduler.stats["retractions"] == 0
        for x, y in zip(a, b, strict=True):
            assert y.finish == {"type": "length", "length": 24}
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-5)
        _assert_all_free(tight)  # nothing leaked
    finally:
        roomy.stop()
        tight.stop()


def test_overlapped_decoding_equals_reading_every_step(model_dir: Path) -> None:
    """Launching step N+1 before reading step N changes nothing a request sees: tokens, log-probs,
    finish reasons (a stop token the host reads one step late, length limits), pool accounting."""
    plain = _paged(model_dir, overlap=False, block_size=4)
    overlapped = _paged(model_dir, block_size=4, kv_tokens=96)  # tight: some decodes must retract
    try:
        free_run = _generate(plain, PROMPTS[:1], temperature=0.9, seed=4, max_new_tokens=12)
        stop_at = free_run[0].output_ids[4]  # a token the first prompt samples mid-way
        per_prompt = [
            {"stop_token_ids": [stop_at]},
            {"max_new_tokens": 3},
            {"max_new_tokens": 17},
            {"temperature": 0.0},
        ]
        kw: dict[str, Any] = dict(temperature=0.9, seed=4, max_new_tokens=12, per_prompt=per_prompt)
        a = _generate(plain, PROMPTS, **kw)
        b = _generate(overlapped, PROMPTS, **kw)
        assert plain.scheduler.stats["overlapped_steps"] == 0
        assert overlapped.scheduler.stats["overlapped_steps"] > 10
        assert b[0].finish is not None and b[0].finish["type"] == "stop" and b[0].output_ids[-1] == stop_at
        for x, y in zip(a, b, strict=True):
            assert y.finish == x.finish
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-6)
            assert y.output_versions == x.output_versions
        _assert_all_free(overlapped)
    finally:
        plain.stop()
        overlapped.stop()


def test_too_long_for_the_pool_is_refused_clearly(model_dir: Path) -> None:
    paged = _paged(model_dir, kv_tokens=16, block_size=4)
    try:
        [r] = _generate(paged, [list(range(1, 30))])
        assert r.finish is not None and r.finish["type"] == "abort"
        assert "KV slots" in r.finish["message"]
    finally:
        paged.stop()


def test_pause_retract_and_release_resume(model_dir: Path) -> None:
    paged = _paged(model_dir)
    try:
        results: list[Any] = []
        worker = threading.Thread(target=lambda: results.extend(_generate(paged, PROMPTS, max_new_tokens=40)))
        paged.scheduler.pause("retract")
        worker.start()
        paged.scheduler.resume()
        paged.scheduler.pause("retract")  # somewhere mid-stream
        freed = paged.release_memory()
        assert freed == paged.paged.pool.shape.bytes(4) and not paged.paged.pool.allocated
        assert paged.server_info()["kv_pool"]["released"]
        paged.resume_memory()
        paged.scheduler.resume()
        worker.join(timeout=120)
        expected = _generate(paged, PROMPTS, max_new_tokens=40)
        for r, e in zip(results, expected, strict=True):
            assert r.output_ids == e.output_ids
            assert r.output_logprobs == pytest.approx(e.output_logprobs, abs=1e-5)
    finally:
        paged.stop()


def test_refusals_and_scoring(model_dir: Path, engine_tmp: Path) -> None:
    paged = _paged(model_dir)
    dynamic = _engine(model_dir, kv_cache="dynamic")
    try:
        req = greedy_request(paged, PROMPTS[0], max_new_tokens=3, top_logprobs_num=2)
        with pytest.raises(ValueError, match="kv-cache dynamic"):
            paged.scheduler.submit(req)
        # Pure scoring is served (by the DynamicCache runner) with the same values as the dynamic engine.
        a = _generate(paged, PROMPTS, max_new_tokens=0, logprob_start_len=0, top_logprobs_num=2)
        b = _generate(dynamic, PROMPTS, max_new_tokens=0, logprob_start_len=0, top_logprobs_num=2)
        for x, y in zip(a, b, strict=True):
            assert x.input_logprobs == pytest.approx(y.input_logprobs, abs=1e-6)
            assert x.input_top == y.input_top
        with pytest.raises(ValueError, match="memory release needs the paged"):
            dynamic.release_memory()
    finally:
        paged.stop()
        dynamic.stop()
    # (Qwen3-MoE runs on the paged path now: test_paged_moe.py; other MoE families are refused there.)
    sliding = make_tiny_qwen3(engine_tmp / "paged-sliding", seed=0, use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="cannot be used here"):
        _paged(sliding)
    fallback = _engine(sliding, kv_cache="auto")
    try:
        assert fallback.server_info()["kv_cache"] == "dynamic"
    finally:
        fallback.stop()
    with pytest.raises(ValueError, match="kv_tokens"):
        _engine(model_dir, kv_cache="paged")


def test_memory_endpoints(model_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from miles.engines.embedded.receivers import InstalledReceivers
    from miles.engines.embedded.server import create_app

    paged = _paged(model_dir)
    dynamic = _engine(model_dir, kv_cache="dynamic")
    try:
        client = TestClient(create_app(paged, InstalledReceivers({}, {})))
        held = paged.paged.pool.nbytes
        r = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert r.status_code == 200 and r.json()["freed_bytes"] == held > 0
        assert client.get("/get_server_info").json()["kv_pool"]["released"]
        bad = client.post("/release_memory_occupation", json={"tags": ["weights"]})
        assert bad.status_code == 400 and "KV cache only" in bad.json()["message"]
        assert client.post("/resume_memory_occupation", json={}).status_code == 200
        free = paged.paged.allocator.num_free
        assert client.post("/resume_memory_occupation").status_code == 200  # a second resume changes nothing
        assert paged.paged.allocator.num_free == free
        out = client.post(
            "/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3}}
        )
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 3
        plain = TestClient(create_app(dynamic, InstalledReceivers({}, {})))
        refused = plain.post("/release_memory_occupation")
        assert refused.status_code == 400 and "paged KV cache" in refused.json()["message"]
    finally:
        paged.stop()
        dynamic.stop()


def test_qwen2_paged_equals_dynamic(engine_tmp: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, eos_token_id=None,
        bos_token_id=None, tie_word_embeddings=True,
    )  # fmt: skip
    path = engine_tmp / "paged-qwen2"
    Qwen2ForCausalLM(config).save_pretrained(path)  # q/k/v biases, no q_norm/k_norm
    dynamic = _engine(path, kv_cache="dynamic")
    paged = _paged(path, chunk_tokens=5)
    try:
        a = _generate(dynamic, PROMPTS, temperature=0.0)
        b = _generate(paged, PROMPTS, temperature=0.0)
        for x, y in zip(a, b, strict=True):
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-5)
    finally:
        dynamic.stop()
        paged.stop()


def test_allocator_random_ops_never_leak() -> None:
    import random

    rng = random.Random(0)
    a = BlockAllocator(33, 4)
    held: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.45 and a.num_free:
            held.append(a.allocate(rng.randint(1, a.num_free)))
        elif op < 0.6 and held:
            shared = rng.choice(held)[:2]
            a.share(shared)
            held.append(shared)
        elif held:
            a.release(held.pop(rng.randrange(len(held))))
        a.check()
        assert a.num_free + len({b for h in held for b in h}) == 32
    for h in held:
        a.release(h)
    assert a.num_free == 32


def test_fifo_step_lock_lets_a_waiter_in_after_one_step() -> None:
    from miles.engines.embedded.scheduler import FifoLock

    lock = FifoLock()
    steps = 0
    steps_with_a_waiter = 0  # steps the scheduler ran while someone was queued for the lock
    stop = threading.Event()

    def loop() -> None:  # the scheduler: retakes the lock right after every step
        nonlocal steps, steps_with_a_waiter
        while not stop.is_set():
            with lock:
                steps += 1
                steps_with_a_waiter += lock.waiting() > 0

    worker = threading.Thread(target=loop)
    worker.start()
    while steps < 10:
        time.sleep(0.0005)
    with lock:  # a weight update: it waits for the step in progress only, not for the batch to drain
        pass
    stop.set()
    worker.join()
    # Counted from the moment the update queued (not from when this thread last looked at `steps`,
    # which the GIL may leave far behind on a loaded machine).
    assert steps_with_a_waiter <= 1


def test_weight_update_and_abort_between_paged_steps(model_dir: Path, engine_tmp: Path) -> None:
    paged = _paged(model_dir)
    other = load_local(make_tiny_qwen3(engine_tmp / "paged-seed8", seed=8))
    tensors = {k: v.detach().contiguous() for k, v in other.named_parameters()}
    try:
        results: list[Any] = []
        worker = threading.Thread(
            target=lambda: results.extend(_generate(paged, [PROMPTS[1]], max_new_tokens=300))
        )
        worker.start()
        while paged.scheduler.stats["decode_steps"] < 5:
            time.sleep(0.0005)
        paged.weights.update(lambda: tensors, "3")
        worker.join(timeout=120)
        [r] = results
        assert r.output_versions[0] == 0 and r.output_versions[-1] == 3
        assert sorted(r.output_versions) == r.output_versions
        # A fresh request runs on the new weights (the runner reads the model's own tensors).
        [fresh] = _generate(paged, [PROMPTS[0]])
        assert fresh.output_logprobs == pytest.approx(
            full_forward_logprobs(other, PROMPTS[0], fresh.output_ids, 0.0), abs=1e-5
        )
        # Aborting a running request gives its blocks back.
        done = threading.Event()
        req = paged.make_request(
            input_ids=PROMPTS[3], rid="long", max_new_tokens=400, temperature=0.0, top_p=1.0, top_k=-1,
            stop_token_ids=[], seed=None, ignore_eos=True, return_logprob=True, return_routed_experts=False,
        )  # fmt: skip
        req.on_done = lambda r: done.set()
        paged.scheduler.submit(req)
        while not req.output_ids:
            time.sleep(0.0005)
        assert paged.scheduler.abort("long") == 1
        assert done.wait(30) and req.finish is not None and req.finish["type"] == "abort"
        _assert_all_free(paged)
    finally:
        paged.stop()


def test_triton_kernels_interpreted_on_cpu() -> None:
    """The CUDA path's Triton kernels, run by Triton's interpreter on the CPU (a subprocess: the
    interpreter is chosen when triton is first imported)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = Path(__file__).with_name("paged_kernels_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": ok") == 5, done.stdout


def test_cuda_kernels_need_a_power_of_two_head_dim_of_at_least_16() -> None:
    # tl.dot needs every tile dimension >= 16 and tl.arange a power of two: a GPU run of a tiny
    # head_dim-8 model failed to compile the decode kernel before this check sent it to the
    # DynamicCache path (auto) or refused it (paged).
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from miles.engines.embedded.paged.model import cuda_kernel_reason

    def reason(head_dim: int) -> str | None:
        config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
        return cuda_kernel_reason(SimpleNamespace(config=config))

    assert reason(16) is None and reason(64) is None and reason(128) is None
    for bad in (8, 24, 96):
        assert reason(bad) is not None and f"head_dim {bad}" in str(reason(bad))
