"""The trainer's scoring pass and PPO's critic on real FSDP ranks (gloo), one and two of them."""

from __future__ import annotations

import pytest
import torch

from fsdp.helpers import build_tiny_qwen3, hf_token_logprobs, make_batch, make_spec
from miles.interfaces import CriticSpec
from miles.types import TrainBatch


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory) -> str:
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("teacher"), seed=7))


def _spec(tiny_model: str, teacher: str, n: int):
    return make_spec(
        tiny_model,
        n,
        loss="ppo_clip",
        temperature=0.7,
        scores=["ref_logprobs", "values", "teacher_logprobs"],
        ref_model_path=tiny_model,
        teacher_model_path=teacher,
        critic=CriticSpec(model_path=tiny_model, lr=0.05),
    )


@pytest.mark.slow
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_scores_match_plain_forwards_and_the_critic_trains(
    tiny_model, teacher_model, backend_factory, num_ranks
):
    batch = make_batch(5, seed=4)
    backend = backend_factory(_spec(tiny_model, teacher_model, num_ranks))
    scores = backend.score(batch.samples, ["ref_logprobs", "values", "teacher_logprobs"])

    # Rows come back in sample order whatever rank and micro-batch scored them.
    for name, model in (("ref_logprobs", tiny_model), ("teacher_logprobs", teacher_model)):
        for got, want in zip(scores[name], hf_token_logprobs(model, batch, 0.7), strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    # The value head starts at zero.
    assert scores["values"] == [[0.0] * len(s.response_ids) for s in batch.samples]

    for sample, ref, values in zip(batch.samples, scores["ref_logprobs"], scores["values"], strict=True):
        sample.token_scores.update(ref_logprobs=ref, values=values)
    returns = [[1.0] * len(s.response_ids) for s in batch.samples]
    metrics = backend.train_step(TrainBatch(batch.samples, batch.advantages, 0, returns=returns))
    # ½(V − R)² with V = 0 and R = 1 everywhere.
    assert metrics["critic/value_loss"] == pytest.approx(0.5)
    assert metrics["critic/grad_norm"] > 0

    after = backend.score(batch.samples, ["values"])["values"]
    trained = [
        v
        for row, s in zip(after, batch.samples, strict=True)
        for v, m in zip(row, s.loss_mask, strict=True)
        if m
    ]
    assert sum(trained) / len(trained) > 0.01  # moved towards the returns (1.0) on average


def test_scoring_something_the_trainer_was_not_built_for_is_refused(tiny_model, backend_factory):
    from miles_fsdp.backend import RankFailedError

    backend = backend_factory(make_spec(tiny_model, 1, loss="ppo_clip"))
    with pytest.raises(RankFailedError, match="cannot score"):
        backend.score(make_batch(2).samples, ["values"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scoring_pass_and_critic_step(tiny_model, teacher_model, backend_factory):
    spec = _spec(tiny_model, teacher_model, 1)
    spec.options["fsdp"]["device"] = "cuda"
    batch = make_batch(4, seed=5)
    backend = backend_factory(spec)
    scores = backend.score(batch.samples, ["ref_logprobs", "values"])
    for got, want in zip(scores["ref_logprobs"], hf_token_logprobs(tiny_model, batch, 0.7), strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    for sample, ref, values in zip(batch.samples, scores["ref_logprobs"], scores["values"], strict=True):
        sample.token_scores.update(ref_logprobs=ref, values=values)
    returns = [[1.0] * len(s.response_ids) for s in batch.samples]
    metrics = backend.train_step(TrainBatch(batch.samples, batch.advantages, 0, returns=returns))
    assert metrics["critic/value_loss"] == pytest.approx(0.5) and metrics["critic/grad_norm"] > 0
