"""A multi-turn episode through the session server on a real MoE engine records the routing of every
position the trainer reads (routing replay, R3): the engine's own routing of each position, checked
against the model's routers on the whole trajectory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine.helpers import hf_routing, running_engine

from miles.routing import replay_problem, sequence_routing
from miles.types import Prompt
from miles_envs.sessions import session_samples
from session_server.conftest import BIG

pytestmark = pytest.mark.slow

EXPERTS, TOPK = 8, 2


def build_polite_qwen3_moe(dest: Path, tokenizer: Any) -> Path:
    """The session server tests' polite model (every reply ``Hi<|im_end|>``) with an MoE block whose
    router is sharp and random, so routing depends on the token and its position."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hi = tokenizer.convert_tokens_to_ids("Hi")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=end,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 1:].normal_(0.0, 1.0)  # token-dependent directions for the router to tell apart
        emb[:, 0] = BIG
        emb[hi, 0] = -BIG
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        head = model.lm_head.weight
        head.zero_()
        head[hi, 0] = BIG
        head[end, 0] = -BIG
        gate = model.model.layers[0].mlp.gate.weight
        gate.normal_(0.0, 2.0)
        gate[:, 0] = 0.0  # blind to the direction every token shares
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def moe_engine(qwen3, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    _, tokenizer = qwen3
    model_dir = build_polite_qwen3_moe(tmp_path_factory.mktemp("polite-qwen3-moe"), tokenizer)
    with running_engine(model_dir, tmp_path_factory.mktemp("logs-moe")) as url:
        yield url, model_dir


def test_a_session_episode_carries_the_routing_of_every_position(qwen3, moe_engine) -> None:
    from session_server.conftest import session_server

    url, model_dir = moe_engine
    with session_server(qwen3, url) as (server, state):
        state.return_routed_experts = True  # what a run that records routing sets
        created = httpx.post(f"{server}/sessions").json()
        messages: list[dict] = [{"role": "user", "content": "Say hi."}]
        for turn in range(3):
            answer = httpx.post(
                f"{created['base_url']}/chat/completions", json={"model": "policy", "messages": messages}
            ).json()
            assert answer["choices"][0]["message"]["content"] == "Hi"
            messages += [answer["choices"][0]["message"], {"role": "user", "content": f"Again ({turn})."}]
        [sample] = session_samples(state.store.get(created["id"]), Prompt(index=0, prompt="x"))
    sample.check_aligned()
    assert replay_problem(sample) is None
    tokens = sample.prompt_ids + sample.response_ids
    rows = sequence_routing(sample)
    assert rows is not None and len(rows) == len(tokens) - 1
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    own = hf_routing(model, tokens)[: len(tokens) - 1].tolist()
    assert len({tuple(sorted(r[0])) for r in own}) >= 5  # routing varies along the sequence
    same = [sorted(r[0]) == sorted(o[0]) for r, o in zip(rows, own, strict=True)]
    # The engine's prefill/decode numerics are not the single forward's: a near-tie may flip.
    assert sum(same) >= 0.95 * len(same), f"{sum(same)} of {len(same)} positions agree"
