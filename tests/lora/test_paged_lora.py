"""LoRA adapters on the embedded engine's paged path (CPU, float32): slots, per-token application,
a mixed batch against the DynamicCache path and the merged model, updates between steps, the
prefix cache per adapter, retraction, unload and refusals."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine.helpers import generate_in_process, greedy_request

from lora.helpers import forward_logprobs, make_adapter, merged_model, submit_all

PROMPTS = [[5, 17, 9, 33, 2], [40, 41, 7, 1, 99, 23, 64, 3, 12], [3, 3, 60, 12, 8], list(range(30, 47))]


def _engine(base: Path, **options: Any) -> Any:
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    opts: dict[str, Any] = dict(
        device="cpu",
        dtype="float32",
        kv_cache="paged",
        kv_tokens=1024,
        block_size=4,
        chunk_tokens=9,  # prompts cut in chunks, adapters mixed inside one prefill step
        max_loras=2,
        max_lora_rank=8,
    )
    opts.update(options)
    engine = EmbeddedEngine(EngineOptions(model_path=str(base), **opts))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def head_adapter(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The projections a and b leave out, and lm_head (adapted on the rows whose logits are taken)."""
    root = tmp_path_factory.mktemp("paged-adapters")
    return make_adapter(tiny_base, root / "c", seed=3, rank=8, targets=["k_proj", "up_proj", "lm_head"])


def _with_adapters(engine: Any, adapters: dict[str, Path]) -> Any:
    engine.load_lora_adapter("a", str(adapters["a"]))
    engine.load_lora_adapter("b", str(adapters["b"]))
    return engine


def _assert_all_free(engine: Any) -> None:
    alloc = engine.paged.allocator
    with engine.scheduler.step_lock:
        alloc.check()
        if engine.scheduler.radix is not None:
            engine.scheduler.radix.check()
        engine.scheduler.flush_prefix_cache()
        assert alloc.num_free == alloc.num_blocks - 1


JOBS: list[tuple[list[int], str | None]] = [
    (PROMPTS[0], "a"),
    (PROMPTS[1], "b"),
    (PROMPTS[2], None),
    (PROMPTS[1], "a"),
    (PROMPTS[3], "b"),
    (PROMPTS[0], None),
    (PROMPTS[3], "c"),
    (PROMPTS[2], "c"),
]


def test_mixed_batch_equals_the_dynamic_path_and_the_merged_model(tiny_base, adapters, head_adapter):
    adapters = {**adapters, "c": head_adapter}
    paged = _with_adapters(_engine(tiny_base, max_loras=3), adapters)
    dynamic = _with_adapters(_engine(tiny_base, kv_cache="dynamic"), adapters)
    try:
        paged.load_lora_adapter("c", str(head_adapter))
        dynamic.load_lora_adapter("c", str(head_adapter))
        got = submit_all(paged, JOBS, max_new_tokens=8)
        want = submit_all(dynamic, JOBS, max_new_tokens=8)
        stats = paged.scheduler.stats
        assert stats["max_decode_batch"] >= 6  # adapters and base rows decoded together
        assert stats["max_prefill_batch"] >= 2 and stats["prefill_chunks"] > len(JOBS)
        assert stats["overlapped_steps"] > 0
        merged = {
            name: merged_model(tiny_base, adapters[name] if name else None) for name in ("a", "b", "c", "")
        }
        for (prompt, lora), x, y in zip(JOBS, want, got, strict=True):
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-5)
            ref = forward_logprobs(merged[lora or ""], prompt, y.output_ids)
            assert y.output_logprobs == pytest.approx(ref, abs=1e-4)
        # The adapters change the output (the comparison above is not the base's against itself).
        assert got[0].output_logprobs != pytest.approx(got[5].output_logprobs, abs=1e-2)
        # A scoring request with an adapter runs the DynamicCache runner on the paged engine's slots.
        scored = [
            greedy_request(e, PROMPTS[1], max_new_tokens=0, logprob_start_len=0, lora="b")
            for e in (paged, dynamic)
        ]
        for e, req in zip((paged, dynamic), scored, strict=True):
            done = threading.Event()
            req.on_done = lambda r, done=done: done.set()
            e.scheduler.submit(req)
            assert done.wait(60) and req.error is None
        assert scored[0].input_logprobs == pytest.approx(scored[1].input_logprobs, abs=1e-5)
        info = paged.server_info()
        assert info["lora_slots"]["free"] == 0 and info["lora_slots"]["max_rank"] == 8
        assert info["lora_slots"]["modules"] == 2 * 7 + 1  # every projection of both layers, lm_head
        assert {a["name"]: a["slot"] for a in info["lora_adapters"]} == {"a": 1, "b": 2, "c": 3}
        _assert_all_free(paged)
    finally:
        paged.stop()
        dynamic.stop()


def test_an_adapter_update_through_the_handoff_lands_between_steps(tiny_base, adapters, tmp_path):
    """The colocated trainer's path: safetensors hand-off files, two buckets, the last with the version."""
    from fastapi.testclient import TestClient
    from safetensors.torch import load_file, save_file

    from miles.engines.digest import tensor_digest
    from miles.engines.embedded.lora import PEFT_PREFIX, tensor_name
    from miles.engines.embedded.receivers import InstalledReceivers
    from miles.engines.embedded.server import create_app

    handoff = tmp_path / "handoff"
    handoff.mkdir()
    new = make_adapter(tiny_base, tmp_path / "a2", seed=7, rank=4, targets=["q_proj", "v_proj", "down_proj"])
    raw = load_file(str(new / "adapter_model.safetensors"))
    sent = {
        tensor_name(k.removeprefix(PEFT_PREFIX).split(".lora_")[0], "A" if ".lora_A" in k else "B", "a"): v
        for k, v in raw.items()
    }
    names = sorted(sent)
    save_file({n: sent[n] for n in names[: len(names) // 2]}, str(handoff / "bucket-0.safetensors"))
    save_file({n: sent[n] for n in names[len(names) // 2 :]}, str(handoff / "bucket-1.safetensors"))

    paged = _with_adapters(_engine(tiny_base, handoff_dir=str(handoff)), adapters)
    client = TestClient(create_app(paged, InstalledReceivers({}, {})))
    try:
        assert sorted(paged.lora_tensor_names("a")) == names
        results: list[Any] = []
        long_jobs = [(PROMPTS[0], "a"), (PROMPTS[2], None), (PROMPTS[1], "b")]
        worker = threading.Thread(
            target=lambda: results.extend(submit_all(paged, long_jobs, max_new_tokens=200))
        )
        worker.start()
        while paged.scheduler.stats["decode_steps"] < 5:
            time.sleep(0.0005)
        for i, version in ((0, None), (1, "3")):
            body: dict[str, Any] = {
                "serialized_named_tensors": [f"bucket-{i}.safetensors"],
                "load_format": "miles_safetensors_file",
                "bucket_index": i,
            }
            if version is not None:
                body["weight_version"] = version
            r = client.post("/update_weights_from_tensor", json=body)
            assert r.status_code == 200, r.text
        worker.join(timeout=120)
        a_row, base_row, b_row = results
        for row in results:  # mid-stream: the first tokens under version 0, the last under 3
            assert row.output_versions[0] == 0 and row.output_versions[-1] == 3
            assert sorted(row.output_versions) == row.output_versions
        assert paged.render(a_row)["meta_info"]["lora_weight_version"] == "3"
        assert paged.render(b_row)["meta_info"]["lora_weight_version"] == "0"  # b was not written
        # What the weight checker digests is what is served: the slot's views hold the new factors.
        sums = client.post("/weights_checker", json={"action": "checksum", "lora_name": "a"}).json()
        assert {n: s["digest"] for n, s in sums.items()} == {n: tensor_digest(t) for n, t in sent.items()}
        # The rows the update did not write are exact across it, every token: the base row and b's.
        plain = forward_logprobs(merged_model(tiny_base, None), PROMPTS[2], base_row.output_ids)
        assert base_row.output_logprobs == pytest.approx(plain, abs=1e-4)
        with_b = forward_logprobs(merged_model(tiny_base, adapters["b"]), PROMPTS[1], b_row.output_ids)
        assert b_row.output_logprobs == pytest.approx(with_b, abs=1e-4)
        # A fresh adapter row runs on the new factors (written into the same slot: no reload).
        [fresh] = submit_all(paged, [(PROMPTS[3], "a")])
        ref = forward_logprobs(merged_model(tiny_base, new), PROMPTS[3], fresh.output_ids)
        assert fresh.output_logprobs == pytest.approx(ref, abs=1e-4)
        info = client.get("/get_server_info").json()
        assert {a["name"]: a["weight_version"] for a in info["lora_adapters"]} == {"a": "3", "b": "0"}
        assert info["prefix_cache"]["flushes"] >= 1  # the update dropped cached KV
        _assert_all_free(paged)
    finally:
        paged.stop()


def test_the_prefix_cache_is_kept_per_adapter(tiny_base, adapters):
    paged = _with_adapters(_engine(tiny_base), adapters)
    prompt = PROMPTS[3]  # 17 tokens: 4 whole blocks of 4
    try:
        [base1] = submit_all(paged, [(prompt, None)])
        [a1] = submit_all(paged, [(prompt, "a")])
        assert a1.cached_tokens == 0  # the base's blocks are not the adapter's
        [a2] = submit_all(paged, [(prompt, "a")])
        assert a2.cached_tokens == 16  # its own blocks are
        [b1] = submit_all(paged, [(prompt, "b")])
        assert b1.cached_tokens == 0
        [base2] = submit_all(paged, [(prompt, None)])
        assert base2.cached_tokens == 16
        for first, again in ((a1, a2), (base1, base2)):
            assert again.output_ids == first.output_ids
            assert again.output_logprobs == pytest.approx(first.output_logprobs, abs=1e-5)
        assert b1.output_ids != a1.output_ids or b1.output_logprobs != pytest.approx(a1.output_logprobs)
        info = paged.scheduler.prefix_cache_info()
        assert info["adapter_trees"] == 2
        entries = info["entries"]
        # Reloading an adapter replaces its factors: its cached KV goes, the others' stay.
        paged.load_lora_adapter("b", str(adapters["b"]))
        after = paged.scheduler.prefix_cache_info()
        assert after["adapter_trees"] == 1 and after["entries"] < entries
        [a3] = submit_all(paged, [(prompt, "a")])
        assert a3.cached_tokens == 16
        paged.unload_lora_adapter("a")  # idle: allowed; its tree goes too
        assert paged.scheduler.prefix_cache_info()["adapter_trees"] == 0
        _assert_all_free(paged)
    finally:
        paged.stop()


def test_retraction_of_adapter_rows_keeps_tokens_and_logprobs(tiny_base, adapters):
    prompts = [list(range(10 + i, 22 + i)) for i in range(6)]
    per_prompt = [
        {"lora": ("a", None, "b")[i % 3]} for i in range(6)
    ]  # the newest rows (retracted first) use adapters
    roomy = _with_adapters(_engine(tiny_base), adapters)
    tight = _with_adapters(_engine(tiny_base, kv_tokens=64), adapters)  # 6 x up to 36 tokens: retracts
    try:
        kw: dict[str, Any] = dict(
            max_new_tokens=24, timeout=120, temperature=0.9, seed=5, per_prompt=per_prompt
        )
        a = generate_in_process(roomy, prompts, **kw)
        b = generate_in_process(tight, prompts, **kw)
        assert tight.scheduler.stats["retractions"] > 0 and roomy.scheduler.stats["retractions"] == 0
        for x, y in zip(a, b, strict=True):
            assert y.finish == {"type": "length", "length": 24}
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-5)
        _assert_all_free(tight)
    finally:
        roomy.stop()
        tight.stop()


def test_unload_and_refusals(tiny_base, adapters, tmp_path):
    from fastapi.testclient import TestClient

    from miles.engines.embedded.lora import LoraError
    from miles.engines.embedded.receivers import InstalledReceivers
    from miles.engines.embedded.server import create_app

    paged = _engine(tiny_base, max_lora_rank=4)
    try:
        # Before any adapter: no hook, no stack (the path runs exactly as without LoRA).
        assert not paged.lora.stacks and not paged.lora._hooks
        _with_adapters(paged, adapters)
        assert len(paged.lora.stacks) == len(paged.lora._hooks) == 10  # 2 layers x (q, v, down, o, gate)
        third = make_adapter(tiny_base, tmp_path / "c", seed=3, rank=2, targets=["q_proj"])
        with pytest.raises(LoraError, match=r"no free adapter slot for 'c'.*--max-loras"):
            paged.load_lora_adapter("c", str(third))
        wide = make_adapter(tiny_base, tmp_path / "w", seed=3, rank=8, targets=["q_proj"])
        paged.unload_lora_adapter("b")
        with pytest.raises(LoraError, match=r"rank 8; .* rank <= 4 .*--max-lora-rank"):
            paged.load_lora_adapter("w", str(wide))
        assert sorted(paged.lora.adapters) == ["a"]  # the refusals changed nothing
        client = TestClient(create_app(paged, InstalledReceivers({}, {})))
        r = client.post("/load_lora_adapter", json={"lora_name": "w", "lora_path": str(wide)})
        assert r.status_code == 400 and "--max-lora-rank" in r.json()["message"]
        r = client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(third)})
        assert r.status_code == 200, r.text
        out = client.post(
            "/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3}, "lora_path": "c"},
        )
        assert out.status_code == 200 and out.json()["meta_info"]["lora_path"] == "c"
        # An adapter in use is not unloaded: one clear error; once its request is gone, it is.
        req = greedy_request(paged, PROMPTS[1], max_new_tokens=400, lora="a")
        done = threading.Event()
        req.on_done = lambda r: done.set()
        paged.scheduler.submit(req)
        while not req.output_ids:
            time.sleep(0.0005)
        with pytest.raises(LoraError, match=r"'a' is used by 1 running or queued request"):
            paged.unload_lora_adapter("a")
        assert paged.scheduler.abort(req.rid) == 1 and done.wait(30)
        paged.unload_lora_adapter("a")
        paged.unload_lora_adapter("c")
        with pytest.raises(LoraError, match="no LoRA adapter 'a'"):
            paged.unload_lora_adapter("a")
        with pytest.raises(ValueError, match="not a loaded adapter"):
            greedy_request(paged, PROMPTS[0], max_new_tokens=2, lora="a")
        # The last adapter gone: stacks and hooks are freed, no adapter tensor is a named weight.
        assert not paged.lora.stacks and not paged.lora._hooks and not paged.lora.slots
        assert not any(".lora_" in n for n in paged.weights.targets)
        _assert_all_free(paged)
    finally:
        paged.stop()


def test_a_request_whose_adapter_was_unloaded_while_queued_is_aborted(tiny_base, adapters):
    paged = _with_adapters(_engine(tiny_base), adapters)
    try:
        req = greedy_request(paged, PROMPTS[0], max_new_tokens=3, lora="b")  # accepted: b is loaded
        paged.unload_lora_adapter("b")  # nothing uses it yet
        done = threading.Event()
        req.on_done = lambda r: done.set()
        paged.scheduler.submit(req)
        assert done.wait(30)
        assert req.finish is not None and req.finish["type"] == "abort"
        assert "LoRA adapter 'b' is not loaded" in req.finish["message"]
    finally:
        paged.stop()


def test_slot_application_equals_per_adapter_hooks_on_random_tokens(tiny_base, adapters):
    """The masked all-slot GEMMs against the DynamicCache path's per-adapter hooks, on one linear
    and a random slot per token (padding, slot 0 and several adapters in one call)."""
    paged = _with_adapters(_engine(tiny_base, max_lora_rank=8), adapters)
    try:
        lora = paged.lora
        module = "model.layers.1.self_attn.q_proj"  # adapted by a only
        linear = lora.linears[module]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(11, linear.in_features, generator=gen)
        slots = torch.randint(0, 3, (11,), generator=gen)
        with torch.no_grad(), lora.tokens(slots):
            got = linear(x)
        a, b = lora.adapters["a"].factors[module]
        want = torch.nn.functional.linear(x, linear.weight)
        rows = slots == lora.slots["a"]
        want[rows] += lora.adapters["a"].scale * (x[rows] @ a.T @ b.T)
        assert torch.allclose(got, want, atol=1e-6)
        with torch.no_grad():
            assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight))  # outside: none
    finally:
        paged.stop()


@pytest.mark.slow
def test_the_decode_graph_body_with_adapter_rows_interpreted_on_cpu(tmp_path):
    """What a CUDA decode graph captures (slots read by table row, fused Triton layers, paged decode
    kernel), run eagerly by Triton's interpreter: adapter rows equal the CPU path's and the merged
    model's (a subprocess: the interpreter is chosen when triton is first imported)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = Path(__file__).with_name("paged_lora_graph_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": ok") == 1 + 3 * 4, done.stdout


def test_qwen3_moe_adapter_rows_equal_the_dynamic_path(tmp_path):
    """On a Qwen3-MoE model (sparse MLPs run by the paged path's own MoE code) adapters of the attention
    projections and lm_head apply per row as on the DynamicCache path, routed experts included."""
    from engine.helpers import make_tiny_qwen3

    base = make_tiny_qwen3(tmp_path / "moe", seed=1, moe=True)
    adapter = make_adapter(base, tmp_path / "m", seed=5, rank=4, targets=["q_proj", "o_proj", "lm_head"])
    jobs: list[tuple[list[int], str | None]] = [(PROMPTS[1], "m"), (PROMPTS[3], None), (PROMPTS[0], "m")]
    engines = [_engine(base), _engine(base, kv_cache="dynamic")]
    try:
        for engine in engines:
            engine.load_lora_adapter("m", str(adapter))
        per_prompt = [{"lora": lora, "return_routed_experts": True} for _, lora in jobs]
        got, want = (
            generate_in_process(e, [p for p, _ in jobs], max_new_tokens=6, timeout=120, per_prompt=per_prompt)
            for e in engines
        )
        for x, y in zip(want, got, strict=True):
            assert y.output_ids == x.output_ids
            assert y.output_logprobs == pytest.approx(x.output_logprobs, abs=1e-5)
            assert torch.equal(torch.cat(y.routed), torch.cat(x.routed))
        ref = forward_logprobs(merged_model(base, adapter), PROMPTS[1], got[0].output_ids)
        assert got[0].output_logprobs == pytest.approx(ref, abs=1e-4)
    finally:
        for engine in engines:
            engine.stop()
