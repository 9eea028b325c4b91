"""The expert pass of the bucketed pipeline: experts after everything else, counted times the EP degree."""

from __future__ import annotations

import pytest
import torch

from miles_transports.bucket import iter_buckets


def _t(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


STREAM = [
    ("model.embed_tokens.weight", _t(40)),
    ("model.layers.0.self_attn.q_proj.weight", _t(40)),
    ("model.layers.0.mlp.gate.weight", _t(10)),
    ("model.layers.0.mlp.experts.0.up_proj.weight", _t(30)),
    ("model.layers.0.mlp.experts.1.up_proj.weight", _t(30)),
    ("model.layers.1.mlp.experts.0.up_proj.weight", _t(30)),
]


def test_experts_never_share_a_bucket_with_the_first_pass() -> None:
    buckets = list(iter_buckets(STREAM, bucket_bytes=1000))
    # Everything fits in one bucket by size, but the pass change flushes: [dense] [experts].
    assert [b.names for b in buckets] == [[n for n, _ in STREAM[:3]], [n for n, _ in STREAM[3:]]]
    assert [b.nbytes for b in buckets] == [90, 90] and [b.last for b in buckets] == [False, True]


def test_expert_tensors_count_times_the_expert_parallel_degree() -> None:
    # Limit 100: dense tensors pack 40+40 (+10 would pass... 90 <= 100, so three), experts cost 30*2=60 each.
    buckets = list(iter_buckets(STREAM, bucket_bytes=100, expert_parallel=2))
    assert [len(b.tensors) for b in buckets] == [3, 1, 1, 1]
    # Without EP the experts pack three to a bucket (90 <= 100).
    assert [len(b.tensors) for b in iter_buckets(STREAM, bucket_bytes=100)] == [3, 3]


def test_a_dense_tensor_after_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match=r"non-expert tensor 'lm_head\.weight' after expert tensors"):
        list(iter_buckets([*STREAM, ("lm_head.weight", _t(4))], bucket_bytes=1000))


def test_fsdp_weight_stream_yields_experts_last() -> None:
    from transformers import AutoModelForCausalLM

    from miles.models.registry import resolve_model
    from miles_fsdp.weights import iter_full_tensors

    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny-qwen3-moe"))
    names = [n for n, _ in iter_full_tensors(model)]
    first_expert = next(i for i, n in enumerate(names) if ".experts." in n)
    assert first_expert > 0 and all(".experts." in n for n in names[first_expert:])
    assert sorted(names) == sorted(model.state_dict().keys() - _tied(model))
    assert len(list(iter_buckets(iter_full_tensors(model), bucket_bytes=1 << 30))) == 2


def _tied(model) -> set[str]:
    return {"lm_head.weight"} if model.config.tie_word_embeddings else set()
