"""The embedded engine serves peft LoRA adapters by name, unmerged, mixed with the base in one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora.helpers import forward_logprobs, merged_model, submit_all

PROMPTS = [[5, 17, 9, 33, 2], [40, 41, 7, 1, 99], [3, 3, 60, 12, 8]]


@pytest.fixture
def engine(tiny_base: Path):
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    eng = EmbeddedEngine(
        EngineOptions(model_path=str(tiny_base), device="cpu", dtype="float32", kv_cache="dynamic")
    )
    eng.start()
    yield eng
    eng.stop()


def test_adapter_logprobs_equal_the_merged_model(engine, tiny_base, adapters):
    engine.load_lora_adapter("a", str(adapters["a"]))
    [req] = submit_all(engine, [(PROMPTS[0], "a")])
    merged = merged_model(tiny_base, adapters["a"])
    expected = forward_logprobs(merged, PROMPTS[0], req.output_ids)
    assert req.output_logprobs == pytest.approx(expected, abs=1e-4)
    # ... and the adapter changes the output: the base scores the same tokens differently.
    base = forward_logprobs(merged_model(tiny_base, None), PROMPTS[0], req.output_ids)
    assert max(abs(x - y) for x, y in zip(base, expected, strict=True)) > 1e-2


def test_mixed_batch_rows_equal_their_single_adapter_outputs(engine, tiny_base, adapters):
    engine.load_lora_adapter("a", str(adapters["a"]))
    engine.load_lora_adapter("b", str(adapters["b"]))
    jobs = [(PROMPTS[0], "a"), (PROMPTS[1], "b"), (PROMPTS[2], None), (PROMPTS[1], "a")]
    mixed = submit_all(engine, jobs)
    assert engine.scheduler.stats["max_prefill_batch"] >= 2  # they did share forwards
    for (prompt, lora), row in zip(jobs, mixed, strict=True):
        [alone] = submit_all(engine, [(prompt, lora)])
        assert row.output_ids == alone.output_ids
        assert row.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
        ref = merged_model(tiny_base, adapters[lora] if lora else None)
        assert row.output_logprobs == pytest.approx(forward_logprobs(ref, prompt, row.output_ids), abs=1e-4)


def test_adapter_tensors_are_named_weights_with_their_own_version(engine, adapters):
    from miles.engines.embedded.lora import tensor_name

    engine.load_lora_adapter("a", str(adapters["a"]))
    names = engine.lora_tensor_names("a")
    module = "model.layers.0.self_attn.q_proj"
    assert tensor_name(module, "A", "a") in names and tensor_name(module, "B", "a") in names
    assert not any("lora_" in n for n in engine.lora_tensor_names("a") if not n.endswith(".a.weight"))
    # The weight checker can cover just the adapter (the base is left alone).
    base_before = engine.weights.checksums(only=["model.embed_tokens.weight"])
    reset, _ = engine.weights.reset_tensors(seed=3, only=names)
    assert sorted(reset) == sorted(names)
    assert engine.weights.checksums(only=["model.embed_tokens.weight"]) == base_before
    # An update that writes only the adapter's tensors gives the adapter (and the engine) its version.
    zeros = {n: torch.zeros_like(engine.weights.targets[n]) for n in names}
    engine.weights.update(lambda: zeros, "7")
    assert engine.lora.adapters["a"].version == "7"
    assert engine.weight_version == "7"
    [req] = submit_all(engine, [(PROMPTS[0], "a")])
    [base] = submit_all(engine, [(PROMPTS[0], None)])
    assert req.output_logprobs == pytest.approx(base.output_logprobs, abs=1e-6)  # zero factors: the base
    meta = engine.render(req)["meta_info"]
    assert meta["lora_path"] == "a" and meta["lora_weight_version"] == "7"


def test_refusals(engine, tiny_base, adapters, tmp_path):
    from miles.engines.embedded.lora import LoraError

    with pytest.raises(LoraError, match="not a peft adapter directory"):
        engine.load_lora_adapter("x", str(tmp_path))
    with pytest.raises(ValueError, match="not a loaded adapter"):
        submit_all(engine, [(PROMPTS[0], "nope")])
    with pytest.raises(LoraError, match="no LoRA adapter 'nope'"):
        engine.unload_lora_adapter("nope")
    engine.load_lora_adapter("a", str(adapters["a"]))
    engine.unload_lora_adapter("a")
    assert not engine.lora._hooks  # no hook left on the base
    assert not any(".lora_" in n for n in engine.weights.targets)


def test_client_bodies_name_the_adapter_as_sglang_does():
    from miles.engines.client import (
        generate_call,
        load_lora_adapter_call,
        unload_lora_adapter_call,
        weights_checker_call,
    )
    from miles.types import SamplingParams

    assert generate_call([1, 2], SamplingParams(), lora_path="a").body["lora_path"] == "a"
    assert "lora_path" not in generate_call([1, 2], SamplingParams()).body
    load = load_lora_adapter_call("a", "/x")
    assert (load.path, load.body) == ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    assert unload_lora_adapter_call("a").body == {"lora_name": "a"}
    assert weights_checker_call("checksum", lora_name="a").body == {"action": "checksum", "lora_name": "a"}
