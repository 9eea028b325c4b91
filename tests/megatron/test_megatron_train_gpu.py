"""The megatron backend on one CUDA GPU (scripts/gpu-tests.sh -k megatron; skipped without CUDA).

A training step lowers the loss; the weight stream is the trainer's parameters converted back
to HF names and an HF model built from the export scores like the trainer; offload / onload and
a checkpoint round trip leave training unchanged; ``miles run`` with ``backend: megatron``, the
embedded engine and the colocated transport finishes (weight-equality check on).
"""

from __future__ import annotations

import os

import pytest
import torch
from megatron_helpers import cuda_run, make_batch, make_checkpoint

from miles.interfaces import BackendSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _spec(path, dtype="float32", loss="sft", lr=1e-2, megatron=None, **train) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss=loss,
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={
            "train": {"lr": lr, "micro_batch_size": 2, "grad_clip": 1.0, **train},
            "megatron": {"params_dtype": dtype, **(megatron or {})},
        },
    )


def test_a_step_lowers_the_loss_and_the_export_is_the_trained_model(tiny, backends, tmp_path):
    import transformers

    from miles_megatron.convert import megatron_to_hf

    backend = backends(_spec(tiny))
    batch = make_batch(6, seed=1)
    losses = [backend.train_step(batch)["train/loss"] for _ in range(5)]
    print("megatron fp32 sft losses", losses)
    assert losses[-1] < losses[0], losses
    trainer = backend.trainer
    stream = dict(trainer.weight_stream())
    want = megatron_to_hf(trainer.hf, trainer.gpt.state_dict())
    assert set(stream) == set(want)
    assert all(torch.equal(stream[k], want[k]) for k in want)
    backend.export_hf(str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).cuda().eval()
    ours = backend.score(batch.samples, ["old_logprobs"])["old_logprobs"]
    for sample, row in zip(batch.samples, ours, strict=True):
        ids = torch.tensor([sample.prompt_ids + sample.response_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=ids).logits.float(), -1)[0]
        p = len(sample.prompt_ids)
        ref = [logp[p - 1 + j, t].item() for j, t in enumerate(sample.response_ids)]
        assert max(abs(a - b) for a, b in zip(row, ref, strict=True)) < 1e-4


def test_policy_loss_with_several_steps_per_batch(tiny, backends):
    backend = backends(_spec(tiny, loss="ppo_clip", lr=1e-3, steps_per_rollout=2))
    metrics = backend.train_step(make_batch(6, seed=2, positive=True))
    assert metrics["train/optimizer_steps"] == 2 and metrics["train/num_loss_tokens"] > 0


def test_bf16_trains_with_fp32_master_weights(tiny, backends):
    backend = backends(_spec(tiny, dtype="bfloat16", lr=1e-2))
    batch = make_batch(6, seed=3)
    losses = [backend.train_step(batch)["train/loss"] for _ in range(5)]
    print("megatron bf16 sft losses", losses)
    assert losses[-1] < losses[0], losses


def test_offload_round_trip_changes_nothing(tiny, backends):
    batches = [make_batch(6, seed=10 + i) for i in range(3)]
    plain = backends(_spec(tiny))
    want = [plain.train_step(b)["train/loss"] for b in batches]
    plain.shutdown()
    backend = backends(_spec(tiny))
    got = [backend.train_step(batches[0])["train/loss"]]
    off = backend.offload()
    print("megatron offload", off)
    assert off["offload/bytes"] > 0
    assert off["offload/cuda_allocated_after"] < off["offload/cuda_allocated_before"]
    with pytest.raises(RuntimeError, match="offloaded"):
        backend.train_step(batches[1])
    on = backend.onload()
    assert on["onload/bytes"] == off["offload/bytes"]
    got += [backend.train_step(b)["train/loss"] for b in batches[1:]]
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_offload_to_disk_through_a_staging_buffer_changes_nothing(tiny, backends, tmp_path):
    batches = [make_batch(6, seed=10 + i) for i in range(3)]
    plain = backends(_spec(tiny, dtype="bfloat16"))
    want = [plain.train_step(b)["train/loss"] for b in batches]
    plain.shutdown()
    spill = tmp_path / "spill"
    spill.mkdir()
    (spill / "keep.txt").write_text("not the offloader's")
    megatron = {"offload_to": "disk", "offload_dir": str(spill), "offload_staging_mb": 1}
    backend = backends(_spec(tiny, dtype="bfloat16", megatron=megatron))
    got = [backend.train_step(batches[0])["train/loss"]]
    for _ in range(2):  # the second cycle reuses the pinned staging buffer
        off = backend.offload()
        print("megatron disk offload", off)
        assert off["offload/bytes"] > 2**20 and off["offload/staging_bytes"] == 2**20
        assert off["offload/cuda_allocated_after"] < off["offload/cuda_allocated_before"]
        assert len(list(spill.iterdir())) == 2
        on = backend.onload()
        print("megatron disk onload", on)
        assert on["onload/bytes"] == off["offload/bytes"]
        assert [p.name for p in spill.iterdir()] == ["keep.txt"]
    got += [backend.train_step(b)["train/loss"] for b in batches[1:]]
    assert got == want  # bit for bit


def test_optimizer_streaming_trains_like_megatrons_optimizer_and_resumes(tiny, backends, tmp_path):
    """FP32 model: the streamed AdamW (torch's update on main_grad, bucket by bucket from disk) against
    megatron's optimizer, step for step; then a checkpoint round trip of the streamed state."""
    batches = [make_batch(6, seed=60 + i) for i in range(3)]
    plain = backends(_spec(tiny))
    want = [plain.train_step(b)["train/loss"] for b in batches]
    plain.shutdown()
    megatron = {
        "optimizer_streaming": True,
        "optimizer_streaming_bucket_mb": 0.05,
        "optimizer_streaming_dir": str(tmp_path),
    }
    streamed = backends(_spec(tiny, megatron=megatron))
    got = []
    for i, b in enumerate(batches):
        got.append(streamed.train_step(b)["train/loss"])
        if i == 1:
            streamed.save_checkpoint(str(tmp_path / "ckpt"))
    opt = streamed.trainer.streaming
    total = opt.disk_bytes()
    print(
        "megatron streaming losses",
        got,
        "vs",
        want,
        "buckets",
        len(opt.buckets),
        "peak",
        opt.peak_resident_bytes,
        "of",
        total,
    )
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    assert got == pytest.approx(want, rel=1e-4)
    assert len(opt.buckets) >= 4 and opt.peak_resident_bytes < total / 2
    streamed.shutdown()
    resumed = backends(_spec(tiny, megatron=megatron))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    again = resumed.train_step(batches[2])["train/loss"]
    assert again == pytest.approx(got[2], rel=1e-6, abs=1e-7)


def test_optimizer_streaming_lowers_peak_gpu_memory(backends, tmp_path):
    """BF16 model of about 20M parameters: megatron's optimizer keeps FP32 masters and two FP32 moments
    on the GPU (12 bytes a parameter); streamed, only a bucket's of them is there at a time."""
    path = make_checkpoint(
        "qwen3",
        tmp_path / "mid",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    )
    batch = make_batch(6, seed=70)
    peaks, losses = {}, {}
    for name, megatron in [
        ("megatron", {}),
        ("streamed", {"optimizer_streaming": True, "optimizer_streaming_bucket_mb": 16}),
        (
            "streamed_bf16_moments",
            {
                "optimizer_streaming": True,
                "optimizer_streaming_bucket_mb": 16,
                "optimizer_streaming_moments": "bfloat16",
            },
        ),
    ]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        backend = backends(_spec(path, dtype="bfloat16", megatron=megatron))
        losses[name] = [backend.train_step(batch)["train/loss"] for _ in range(3)]
        peaks[name] = torch.cuda.max_memory_allocated() / 2**20
        backend.shutdown()
        torch.cuda.empty_cache()
    print("megatron streaming peak GPU MiB", peaks, "losses", losses)
    assert peaks["streamed"] < peaks["megatron"] - 150, peaks  # about 20M x 12 bytes = 230 MiB of state
    assert losses["streamed"][-1] < losses["streamed"][0]
    assert losses["streamed"] == pytest.approx(losses["megatron"], rel=2e-2)


def test_checkpoint_round_trip_resumes_exactly(tiny, backends, tmp_path):
    batches = [make_batch(6, seed=20 + i) for i in range(2)]
    first = backends(_spec(tiny))
    first.train_step(batches[0])
    first.save_checkpoint(str(tmp_path / "ckpt"))
    want = first.train_step(batches[1])["train/loss"]
    first.shutdown()
    resumed = backends(_spec(tiny))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = resumed.train_step(batches[1])["train/loss"]
    print("megatron resume", want, got)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_miles_run_with_the_megatron_backend_on_cuda(tmp_path):
    rows, run_dir = cuda_run(tmp_path, "train.lr=0.01")
    print(
        "megatron run", [{k: r.get(k) for k in ("step", "train/loss", "engine/weight_version")} for r in rows]
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["engine/weight_version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all("train/loss" in r for r in rows)
    final = os.path.join(run_dir, "final")
    assert os.path.isfile(os.path.join(final, "model.safetensors"))
