"""Offload for colocated placement on CUDA (run by scripts/gpu-tests.sh; skipped without CUDA).

The trainer's GPU state (FSDP shards, optimizer moments) must really leave the GPU, and
come back bit for bit: training after a round trip matches training without one.
"""

from __future__ import annotations

import pytest
import torch

from fsdp.helpers import build_tiny_qwen3, make_batch, make_spec, weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KEYS = ("train/loss", "train/grad_norm", "train/entropy")


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A few million parameters, so the freed memory is far above the allocator's granularity."""
    shape = {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    }
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("wider-qwen3"), **shape))


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_offload_frees_the_trainer_state_and_onload_restores_it_exactly(
    wider_model, backend_factory, num_ranks
):
    if torch.cuda.device_count() < num_ranks:
        pytest.skip(f"needs {num_ranks} GPUs, {torch.cuda.device_count()} visible")
    batches = [make_batch(6, seed=41 + i, step=i) for i in range(3)]
    spec = make_spec(wider_model, num_ranks, fsdp={"device": "cuda"}, train={"micro_batch_size": 3})
    plain = backend_factory(spec)
    want = [plain.train_step(b) for b in batches]
    plain.shutdown()

    backend = backend_factory(spec)
    got = [backend.train_step(batches[0])]
    off = backend.offload()
    # float32 parameters plus AdamW's two moments, summed over the ranks' shards.
    state_bytes = 3 * sum(t.numel() * 4 for t in weights(wider_model).values())
    assert off["offload/bytes"] >= state_bytes
    freed = off["offload/cuda_allocated_before"] - off["offload/cuda_allocated_after"]
    assert freed >= state_bytes, (freed, state_bytes)
    assert off["offload/seconds"] > 0
    on = backend.onload()
    assert on["onload/bytes"] == off["offload/bytes"]
    got += [backend.train_step(b) for b in batches[1:]]
    for a, b in zip(want, got, strict=True):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
