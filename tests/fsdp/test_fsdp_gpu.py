"""FSDP2 on NCCL (run by scripts/gpu-tests.sh on the GPU machine; skipped without CUDA)."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from fsdp.helpers import dumped_logprobs, hf_token_logprobs, make_batch, make_spec, weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")


def test_nccl_two_ranks_update_like_one_rank(tiny_model, backend_factory, tmp_path):
    _need_gpus(2)
    batches = [make_batch(6, seed=2, step=0), make_batch(6, seed=3, step=1)]
    results = {}
    for n in (1, 2):
        spec = make_spec(
            tiny_model, n, train={"micro_batch_size": 2, "grad_clip": 0.05}, fsdp={"device": "cuda"}
        )
        backend = backend_factory(spec)
        metrics = [backend.train_step(b) for b in batches]
        backend.export_hf(str(tmp_path / f"r{n}"))
        backend.shutdown()
        results[n] = (metrics, weights(str(tmp_path / f"r{n}")))
    (m1, w1), (m2, w2) = results[1], results[2]
    for a, b in zip(m1, m2, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-5, rtol=1e-4)


def test_cuda_logprobs_match_plain_hf_forward(tiny_model, backend_factory, tmp_path):
    _need_gpus(1)
    batch = make_batch(5, seed=1)
    spec = make_spec(
        tiny_model, 1, loss_options={"dump_dir": str(tmp_path)}, temperature=0.7, fsdp={"device": "cuda"}
    )
    backend = backend_factory(spec)
    backend.train_step(batch)
    got = dumped_logprobs(str(tmp_path))
    for i, ref in enumerate(hf_token_logprobs(tiny_model, batch, 0.7)):
        torch.testing.assert_close(torch.tensor(got[i]), torch.tensor(ref), atol=1e-4, rtol=0)


def test_bf16_mixed_precision_trains_and_checkpoints(tiny_model, backend_factory, tmp_path):
    _need_gpus(1)
    batch = make_batch(4, seed=4, positive=True)
    fsdp = {
        "device": "cuda",
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "gradient_checkpointing": True,
    }
    backend = backend_factory(make_spec(tiny_model, 1, train={"lr": 3e-3, "micro_batch_size": 4}, fsdp=fsdp))
    losses = [backend.train_step(batch)["train/loss"] for _ in range(5)]
    assert losses[-1] < losses[0], losses
    backend.save_checkpoint(str(tmp_path / "ckpt"))
    backend.export_hf(str(tmp_path / "hf"))
    assert glob.glob(os.path.join(tmp_path, "hf", "*.safetensors"))
    resumed = backend_factory(make_spec(tiny_model, 1, train={"lr": 3e-3, "micro_batch_size": 4}, fsdp=fsdp))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    a, b = backend.train_step(batch), resumed.train_step(batch)
    assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-3)
