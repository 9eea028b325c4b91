"""PPO's critic on the megatron backend on one CUDA GPU (scripts/gpu-tests.sh -k critic; skipped without CUDA).

Its values equal the FSDP backend's ``ValueModel`` of the same weights (float32); a critic step in
bf16 (megatron's DDP and optimizer, FP32 master weights) lowers the value loss; megatron's
dist-checkpointing resumes the critic and its optimizer; offload / onload moves the critic too.
"""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import make_batch

from miles.interfaces import BackendSpec, CriticSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VALUES = "values"


def _spec(path, dtype="float32", critic_lr=1e-2, **megatron) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="ppo_clip",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        scores=[VALUES],
        critic=CriticSpec(model_path=str(path), lr=critic_lr),
        options={
            "train": {"lr": 1e-3, "micro_batch_size": 2, "grad_clip": 1.0},
            "megatron": {"params_dtype": dtype, **megatron},
        },
    )


def _ppo_batch(backend, seed: int):
    batch = make_batch(n=6, seed=seed)
    values = backend.score(batch.samples, [VALUES])[VALUES]
    for sample, row in zip(batch.samples, values, strict=True):
        sample.token_scores[VALUES] = row
    batch.returns = [
        [float((i + j) % 3 - 1) for j in range(len(s.response_ids))] for i, s in enumerate(batch.samples)
    ]
    return batch


def test_values_equal_the_fsdp_value_model(tiny, backends):
    import transformers

    from miles_fsdp.models import ValueModel

    backend = backends(_spec(tiny))
    critic = backend.trainer.critic
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a head that is not zero, the same in both models
        critic.gpt.output_layer.weight.copy_(torch.randn(1, critic.hf.hidden_size, generator=g).cuda())
        critic.gpt.output_layer.bias.fill_(0.25)
    model = ValueModel(transformers.AutoModel.from_pretrained(tiny, dtype=torch.float32)).cuda().eval()
    model.value_head.load_state_dict(
        {"weight": critic.gpt.output_layer.weight.detach(), "bias": critic.gpt.output_layer.bias.detach()}
    )
    batch = make_batch(n=6, seed=4)
    ours = backend.score(batch.samples, [VALUES])[VALUES]
    for sample, row in zip(batch.samples, ours, strict=True):
        ids = torch.tensor([sample.prompt_ids + sample.response_ids], device="cuda")
        with torch.no_grad():
            values = model(input_ids=ids)[0]
        p = len(sample.prompt_ids)
        ref = values[p - 1 : p - 1 + len(sample.response_ids)].tolist()
        assert max(abs(a - b) for a, b in zip(row, ref, strict=True)) < 1e-4


def test_a_bf16_critic_step_lowers_the_value_loss(tiny, backends):
    backend = backends(_spec(tiny, dtype="bfloat16"))
    losses = []
    for _ in range(5):
        metrics = backend.train_step(_ppo_batch(backend, seed=7))
        losses.append(metrics["critic/value_loss"])
        assert metrics["critic/update_skipped"] == 0.0 and metrics["critic/grad_norm"] > 0
    print("megatron bf16 critic value losses", losses)
    assert losses[-1] < losses[0], losses
    assert backend.trainer.critic.steps == 5


def test_a_dist_checkpoint_resumes_the_critic(tiny, backends, tmp_path):
    first = backends(_spec(tiny))
    for i in range(2):
        first.train_step(_ppo_batch(first, seed=20 + i))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    batch = _ppo_batch(first, seed=30)
    want = first.train_step(batch)
    first.shutdown()
    assert (tmp_path / "ckpt" / "critic_dist").is_dir()
    resumed = backends(_spec(tiny))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.trainer.critic.steps == 2
    assert resumed.score(batch.samples, [VALUES])[VALUES] == pytest.approx(
        [s.token_scores[VALUES] for s in batch.samples], abs=1e-6
    )
    got = resumed.train_step(batch)
    for key in ("critic/value_loss", "critic/grad_norm", "train/loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_offload_moves_the_critic_and_brings_it_back(tiny, backends):
    spec = _spec(tiny, dtype="bfloat16")
    spec.critic, spec.scores = None, []
    alone = backends(spec)
    alone.train_step(make_batch(n=6, seed=40))
    policy_bytes = alone.offload()["offload/bytes"]
    alone.onload()
    alone.shutdown()
    backend = backends(_spec(tiny, dtype="bfloat16"))
    batch = _ppo_batch(backend, seed=40)
    backend.train_step(batch)
    before = backend.score(batch.samples, [VALUES])[VALUES]
    off = backend.offload()
    # The critic's weights, gradients and optimizer state leave with the policy's.
    assert off["offload/bytes"] > 1.5 * policy_bytes
    assert off["offload/cuda_allocated_after"] < off["offload/cuda_allocated_before"]
    backend.onload()
    assert backend.score(batch.samples, [VALUES])[VALUES] == before
