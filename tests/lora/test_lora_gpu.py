"""LoRA on CUDA (run by scripts/gpu-tests.sh on the GPU machine; skipped without CUDA): bf16 engine
serving of adapters, and FSDP LoRA training with a peft export, on one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp.helpers import make_batch

from lora.helpers import make_adapter
from lora.test_fsdp_lora import lora_spec, peft_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 9, 33, 2], [40, 41, 7, 1, 99]]


def _merged_logprobs(base: Path, adapter: Path, prompt: list[int], output: list[int]) -> list[float]:
    from lora.helpers import forward_logprobs, merged_model

    return forward_logprobs(merged_model(base, adapter), prompt, output)


def test_bf16_engine_adapter_rows_match_the_merged_model(tiny_base, tmp_path):
    from lora.helpers import submit_all
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    adapter = make_adapter(tiny_base, tmp_path / "a", seed=1, rank=4, targets=["q_proj", "down_proj"])
    engine = EmbeddedEngine(
        EngineOptions(model_path=str(tiny_base), device="cuda", dtype="bfloat16", kv_cache="dynamic")
    )
    engine.start()
    try:
        engine.load_lora_adapter("a", str(adapter))
        jobs: list[tuple[list[int], str | None]] = [(PROMPTS[0], "a"), (PROMPTS[1], None), (PROMPTS[1], "a")]
        mixed = submit_all(engine, jobs)
        for (prompt, lora), row in zip(jobs, mixed, strict=True):
            [alone] = submit_all(engine, [(prompt, lora)])
            assert row.output_ids == alone.output_ids
        want = _merged_logprobs(tiny_base, adapter, PROMPTS[0], mixed[0].output_ids)
        assert mixed[0].output_logprobs == pytest.approx(want, abs=5e-2)  # bf16 engine, fp32 reference
    finally:
        engine.stop()


def test_cuda_lora_training_exports_a_peft_adapter(tiny_base, tmp_path, backend_factory):
    from miles.train_rows import OLD_LOGPROBS

    spec = lora_spec(tiny_base, tmp_path)
    spec.options["fsdp"]["device"] = "cuda"
    spec.options["fsdp"]["param_dtype"] = "bfloat16"
    backend = backend_factory(spec)
    batch = make_batch(6, seed=3, positive=True)
    for i in range(3):
        backend.train_step(make_batch(6, seed=3, positive=True, step=i))
    got = backend.score(batch.samples, [OLD_LOGPROBS])[OLD_LOGPROBS]
    backend.export_hf(str(tmp_path / "final"))
    ref = peft_logprobs(tiny_base, str(tmp_path / "final"), batch)
    for g, w in zip(got, ref, strict=True):
        assert g == pytest.approx(w, abs=5e-2)
