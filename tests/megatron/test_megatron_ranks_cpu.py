"""The multi-rank launch on CPU over gloo (``megatron.device: cpu``): TP = 2 in two rank processes.

One tiny Qwen3 checkpoint and one batch, trained by the real backend twice: one rank in this
process (TP = 1) and two spawned rank processes (TP = 2, megatron's column- and row-parallel
layers, the vocab-parallel embedding and output layer over gloo). The per-token log-probs, the
train step's loss, the log-probs after that step, and the export gathered over the TP group
(== the checkpoint's HF tensors) must agree.
"""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import checkpoint_tensors, make_batch, make_checkpoint
from safetensors.torch import load_file

from miles.errors import ConfigError
from miles.interfaces import BackendSpec
from miles_megatron.backend import MegatronBackend

pytestmark = pytest.mark.slow


def _spec(path, **megatron) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="ppo_clip",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={
            # eps well above float noise: Adam's first step is lr * g / (|g| + eps), and a gradient
            # that is 0 up to rounding would otherwise move by +-lr on one layout and not the other.
            "train": {"lr": 1e-2, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 1.0, "weight_decay": 0.01},
            "megatron": dict(device="cpu", params_dtype="float32", **megatron),
        },
    )


def _run(path, out, **megatron):
    backend = MegatronBackend()
    backend.setup(_spec(path, **megatron))
    try:
        batch = make_batch(n=5, seed=1)
        backend.export_hf(str(out))
        before = backend.score(batch.samples, ["old_logprobs"])["old_logprobs"]
        metrics = backend.train_step(batch)
        after = backend.score(batch.samples, ["old_logprobs"])["old_logprobs"]
        return before, metrics, after
    finally:
        backend.shutdown()


def _close(a: list[list[float]], b: list[list[float]], tol: float) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)) <= tol


def test_tp2_over_gloo_equals_one_rank(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    one = _run(path, tmp_path / "one")
    two = _run(path, tmp_path / "two", num_ranks=2, tensor_parallel=2)
    assert _close(one[0], two[0], 1e-5)
    assert abs(one[1]["train/loss"] - two[1]["train/loss"]) < 1e-5
    assert abs(one[1]["train/grad_norm"] - two[1]["train/grad_norm"]) < 1e-4
    assert _close(one[2], two[2], 1e-4)  # one AdamW step on the TP shards == on the whole model
    assert not _close(one[0], one[2], 1e-3)  # and the step changed the model
    hf = checkpoint_tensors(path)
    for run in ("one", "two"):
        exported = load_file(str(tmp_path / run / "model.safetensors"))
        assert set(exported) == set(hf)
        assert all(torch.equal(exported[k], hf[k]) for k in hf), run


def test_dp2_over_gloo_equals_one_rank(tmp_path):
    """DP = 2: two rank processes each train on their share of the micro-batches (5 samples in
    micro-batches of 2: shares of 2 and 1), the gradients summed over the DP group; the step's loss,
    gradient norm and the log-probs before and after it equal one rank's, and the scores come back
    in the batch's order."""
    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    one = _run(path, tmp_path / "one")
    two = _run(path, tmp_path / "two", num_ranks=2)
    assert _close(one[0], two[0], 1e-6)
    assert abs(one[1]["train/loss"] - two[1]["train/loss"]) < 1e-6
    assert abs(one[1]["train/grad_norm"] - two[1]["train/grad_norm"]) < 1e-5
    assert one[1]["train/num_tokens"] == two[1]["train/num_tokens"]
    assert _close(one[2], two[2], 1e-5)
    assert not _close(one[0], one[2], 1e-3)


def test_dp_is_refused_on_cuda_in_one_line():
    from miles_megatron.config import MegatronOptions
    from miles_megatron.hooks import launch_problems

    assert launch_problems(MegatronOptions(num_ranks=2, device="cpu")) == []
    (problem,) = launch_problems(MegatronOptions(num_ranks=4, tensor_parallel=2, device="cuda"))
    assert "data parallelism (DP = 2) runs on megatron.device cpu only" in problem


def test_cpu_launch_refuses_what_it_does_not_run(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    for megatron, said in [
        (dict(num_ranks=2, context_parallel=2), "megatron.context_parallel is 2"),
        (dict(num_ranks=2, tensor_parallel=2, sequence_parallel=True), "megatron.sequence_parallel is true"),
    ]:
        with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
            MegatronBackend().setup(_spec(path, **megatron))
    moe = make_checkpoint("qwen3_moe", tmp_path / "moe")
    with pytest.raises(ConfigError, match=r"a MoE model on more than one rank is not run yet"):
        MegatronBackend().setup(_spec(moe, num_ranks=2))


def test_a_moe_model_trains_on_one_cpu_rank(tmp_path):
    """Qwen3-MoE (4 experts top-2, a dense layer) on one CPU rank: megatron's MoE layers with the CPU
    router (``cpu.CPUTopKRouter``) and the allgather dispatcher; one step moves the log-probs."""
    path = make_checkpoint("qwen3_moe", tmp_path / "hf", tie_word_embeddings=False, mlp_only_layers=[1])
    before, metrics, after = _run(path, tmp_path / "out")
    assert metrics["train/grad_norm"] > 0 and metrics["train/loss"] == metrics["train/loss"]
    assert not _close(before, after, 1e-3)
    hf = checkpoint_tensors(path)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(hf) and all(torch.equal(exported[k], hf[k]) for k in hf)


def test_streamed_optimizer_over_tp2_ranks_resumes_on_its_layout_and_on_one_rank(tmp_path):
    """Optimizer-state streaming on two TP ranks: each rank streams its own shards' state; the TP = 2
    run matches the TP = 1 run, resumes from its checkpoint, and one rank resumes it too (its buckets
    rebuilt from both ranks' files, ``miles_megatron.reshard``): the next loss is the TP = 2 run's."""
    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    batches = [make_batch(n=5, seed=60 + i) for i in range(2)]
    streamed = dict(optimizer_streaming=True, optimizer_streaming_bucket_mb=0.02)

    def run(ckpt=None, save=None, **megatron):
        backend = MegatronBackend()
        backend.setup(_spec(path, **streamed, **megatron))
        try:
            if ckpt is not None:
                backend.load_checkpoint(str(ckpt))
                return [backend.train_step(batches[1])["train/loss"]]
            losses = [backend.train_step(batches[0])["train/loss"]]
            if save is not None:
                backend.save_checkpoint(str(save))
            return [*losses, backend.train_step(batches[1])["train/loss"]]
        finally:
            backend.shutdown()

    one = run()
    two = run(save=tmp_path / "ckpt2", num_ranks=2, tensor_parallel=2)
    assert two == pytest.approx(one, abs=1e-5)
    assert sorted(p.name for p in (tmp_path / "ckpt2" / "streaming").iterdir()) == ["rank00000", "rank00001"]
    assert run(ckpt=tmp_path / "ckpt2", num_ranks=2, tensor_parallel=2) == [two[1]]
    assert run(ckpt=tmp_path / "ckpt2") == pytest.approx([two[1]], abs=1e-5)
