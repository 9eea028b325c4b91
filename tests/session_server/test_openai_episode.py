"""The `openai` SDK as the agent: multi-turn episodes through the session server, token-exact."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from miles.types import Prompt
from miles_envs.sessions import session_samples
from session_server.conftest import session_server

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


def _new_session(url: str) -> tuple[str, str]:
    created = httpx.post(f"{url}/sessions").json()
    return created["id"], created["base_url"]


def test_openai_sdk_multi_turn_episode_is_token_exact(qwen3, engine_url):
    from openai import OpenAI

    family, tokenizer = qwen3
    with session_server(qwen3, engine_url) as (url, state):
        session_id, base_url = _new_session(url)
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages: list[dict] = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hi."},
        ]
        replies = []
        for turn in range(3):
            response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            choice = response.choices[0]
            assert choice.finish_reason == "stop"
            assert choice.message.content == "Hi"
            replies.append(response)
            # The agent replays exactly what it got back (the SDK's own message object).
            messages.append(choice.message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": f"And again ({turn})."})

        session = state.store.get(session_id)
        [sample] = session_samples(session, Prompt(index=0, prompt=messages[:2]))
        sample.check_aligned()
        # What the trainer gets is what the engine consumed and produced: the first render, then
        # per turn the model's own tokens (mask 1) and the appended suffix (mask 0).
        full = sample.prompt_ids + sample.response_ids
        first = family.render_ids(tokenizer, messages[:2], TOOLS, add_generation_prompt=True)
        assert sample.prompt_ids == first
        hi, end = tokenizer.convert_tokens_to_ids(["Hi", "<|im_end|>"])
        generated = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m == 1]
        assert generated == [hi, end] * 2 + [hi, end]  # three replies of "Hi<|im_end|>"
        assert sum(r.usage.completion_tokens for r in replies) == len(generated)
        assert all(lp <= 0.0 for lp in sample.rollout_logprobs)
        assert all(v == 0 for v in sample.weight_versions)
        # The last turn's prompt was the whole recorded sequence so far: history was never re-tokenized
        # (a re-render of the history by the template would differ: it may rewrite earlier turns).
        assert replies[-1].usage.prompt_tokens == len(full) - 2
        masked = tokenizer.decode(
            [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m == 0]
        )
        assert "And again (0)." in masked and "And again (1)." in masked


def test_agent_token_fields_are_ignored_and_history_divergence_is_refused(qwen3, engine_url):
    with session_server(qwen3, engine_url) as (url, _):
        _, base_url = _new_session(url)
        chat = f"{base_url}/chat/completions"
        first = [{"role": "user", "content": "Say hi."}]
        r1 = httpx.post(chat, json={"messages": first, "prompt_token_ids": [1, 2, 3]}).json()
        assert r1["choices"][0]["message"]["content"] == "Hi"
        history = [*first, r1["choices"][0]["message"], {"role": "user", "content": "More."}]
        assert httpx.post(chat, json={"messages": history}).status_code == 200
        # Rewriting an earlier turn is not an extension of this linear session.
        forged = [{"role": "user", "content": "Something else."}, *history[1:]]
        bad = httpx.post(chat, json={"messages": forged})
        assert bad.status_code == 409, bad.text
        assert bad.json()["error"]["type"] == "history_diverged"


def test_unknown_session_and_bad_bodies_are_4xx(qwen3, engine_url):
    with session_server(qwen3, engine_url) as (url, _):
        missing = httpx.post(
            f"{url}/sessions/nope/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert missing.status_code == 404
        _, base_url = _new_session(url)
        for body in (
            {},
            {"messages": []},
            {"messages": [{"role": "robot"}]},
            {"messages": [{"role": "user"}], "n": 2},
        ):
            assert httpx.post(f"{base_url}/chat/completions", json=body).status_code == 422, body


def test_concurrent_requests_to_one_linear_session_are_serialised_or_refused(qwen3, engine_url):
    with session_server(qwen3, engine_url) as (url, state):
        session_id, base_url = _new_session(url)
        body = {"messages": [{"role": "user", "content": "Say hi."}]}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(
                pool.map(
                    lambda _: httpx.post(f"{base_url}/chat/completions", json=body, timeout=60).status_code,
                    range(4),
                )
            )
        assert set(codes) <= {200, 409} and codes.count(200) >= 1, codes
        # Whatever was accepted left one consistent sequence.
        [sample] = session_samples(state.store.get(session_id), Prompt(index=0, prompt=body["messages"]))
        sample.check_aligned()
