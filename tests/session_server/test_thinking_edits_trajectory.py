"""Driven as an agent would, with the official ``openai`` client over the real Qwen3 tokenizer and
template, in front of a real embedded engine: the per-request thinking switch, a client-edited
reply followed by more turns, and the read-only trajectory route."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from miles.types import Prompt
from miles_envs.sessions import session_samples
from session_server.conftest import session_server

pytestmark = pytest.mark.slow

OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def _client(url: str) -> tuple[str, Any]:
    from openai import OpenAI

    created = httpx.post(f"{url}/sessions").json()
    return created["id"], OpenAI(base_url=created["base_url"], api_key="unused", max_retries=0)


def _official(tokenizer: Any, messages: list[dict], *, generation: bool) -> list[int]:
    """The official Qwen3 template (no family edits), rendered with thinking off."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, enable_thinking=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _trajectory(url: str, session_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/sessions/{session_id}/trajectory")
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_thinking_off_per_request_is_token_exact_from_the_first_token(qwen3, engine_url):
    family, tokenizer = qwen3
    with session_server(qwen3, engine_url) as (url, state):
        session_id, client = _client(url)
        messages: list[dict] = [{"role": "user", "content": "Say hi."}]
        for turn in range(3):
            response = client.chat.completions.create(model="policy", messages=messages, extra_body=OFF)
            assert response.choices[0].message.content == "Hi"
            if turn == 0:
                # The first prompt is the official template's, switch off: it ends in an empty think block.
                assert response.usage.prompt_tokens == len(_official(tokenizer, messages, generation=True))
            messages.append(response.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": f"Again ({turn})."})
        [trajectory] = _trajectory(url, session_id)["trajectories"]
        tokens = trajectory["prompt_ids"] + trajectory["response_ids"]
        assert trajectory["prompt_ids"] == _official(tokenizer, messages[:1], generation=True)
        assert tokenizer.decode(trajectory["prompt_ids"]).endswith("<think>\n\n</think>\n\n")
        # The whole conversation, rendered by the template with the switch off, is what was recorded
        # (up to the template's newline after the last stop token).
        whole = family.render_ids(
            tokenizer, messages[:-1], add_generation_prompt=False, enable_thinking=False
        )
        assert whole[: len(tokens)] == tokens and tokenizer.decode(whole[len(tokens) :]) == "\n"
        # The route shows what the trainer gets.
        [sample] = session_samples(state.store.get(session_id), Prompt(index=0, prompt=messages[:1]))
        assert trajectory["response_ids"] == sample.response_ids
        assert trajectory["loss_mask"] == sample.loss_mask
        assert trajectory["rollout_logprobs"] == pytest.approx(sample.rollout_logprobs)
        assert trajectory["status"] == "completed" and trajectory["finish_reason"] == "stop"
        hi, end = tokenizer.convert_tokens_to_ids(["Hi", "<|im_end|>"])
        assert [t for t, m in zip(trajectory["response_ids"], trajectory["loss_mask"], strict=True) if m] == [
            hi,
            end,
        ] * 3


def test_run_default_switch_and_request_override(qwen3, engine_url):
    _, tokenizer = qwen3
    hello = [{"role": "user", "content": "Say hi."}]
    with session_server(qwen3, engine_url, chat_template_kwargs={"enable_thinking": False}) as (url, _):
        session_id, client = _client(url)
        client.chat.completions.create(model="policy", messages=hello)  # no kwargs: the run's default (off)
        assert _trajectory(url, session_id)["trajectories"][0]["prompt_ids"] == _official(
            tokenizer, hello, generation=True
        )
        session_id, client = _client(url)
        on = {"chat_template_kwargs": {"enable_thinking": True}}
        client.chat.completions.create(model="policy", messages=hello, extra_body=on)
        prompt = _trajectory(url, session_id)["trajectories"][0]["prompt_ids"]
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")  # the request's switch wins
        # A key the family's template does not take is one clear 400, never ignored.
        from openai import BadRequestError

        for kwargs in ({"thinking": False}, {"enable_thinking": "off"}, {"clear_thinking": False}):
            with pytest.raises(BadRequestError) as info:
                client.chat.completions.create(
                    model="policy", messages=hello, extra_body={"chat_template_kwargs": kwargs}
                )
            assert info.value.status_code == 400
            assert info.value.body["type"] == "invalid_chat_template_kwargs", info.value.body
            assert "qwen3" in info.value.body["message"]


def test_a_client_edited_reply_followed_by_more_turns(qwen3, engine_url):
    family, tokenizer = qwen3
    with session_server(qwen3, engine_url) as (url, state):
        session_id, client = _client(url)
        messages: list[dict] = [{"role": "user", "content": "Say hi."}]
        for turn in range(2):
            reply = client.chat.completions.create(model="policy", messages=messages, extra_body=OFF)
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"Q{turn}"},
            ]
        # The agent rewrites the model's latest reply and carries on: the session retries that turn,
        # with the edited reply as history.
        messages[3] = {"role": "assistant", "content": "Hello there, edited."}
        reply = client.chat.completions.create(model="policy", messages=messages, extra_body=OFF)
        assert reply.choices[0].message.content == "Hi"
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Last."})
        client.chat.completions.create(model="policy", messages=messages, extra_body=OFF)  # and on
        assert state.store.get(session_id).stats()["retried_turns"] == 1
        [trajectory] = _trajectory(url, session_id)["trajectories"]
        tokens = trajectory["prompt_ids"] + trajectory["response_ids"]
        # Token-exact: the template's rendering of the conversation as it now stands (the edited reply
        # in it, then the last reply), with the switch off, up to its newline after the last stop token.
        final = [*messages, {"role": "assistant", "content": "Hi"}]
        whole = family.render_ids(tokenizer, final, add_generation_prompt=False, enable_thinking=False)
        assert whole[: len(tokens)] == tokens and tokenizer.decode(whole[len(tokens) :]) == "\n"
        mask = trajectory["loss_mask"]
        trained = tokenizer.decode([t for t, m in zip(trajectory["response_ids"], mask, strict=True) if m])
        untrained = tokenizer.decode(
            [t for t, m in zip(trajectory["response_ids"], mask, strict=True) if not m]
        )
        assert "edited" not in trained and "Hello there, edited." in untrained  # the model never sampled it
        assert trained == "Hi<|im_end|>" * 3
        assert all(lp == 0.0 for lp, m in zip(trajectory["rollout_logprobs"], mask, strict=True) if not m)


def test_trajectory_route_is_read_only_and_documented(qwen3, engine_url):
    with session_server(qwen3, engine_url, mode="branching") as (url, state):
        session_id, client = _client(url)
        assert _trajectory(url, session_id) == {"id": session_id, "mode": "branching", "trajectories": []}
        hello = [{"role": "user", "content": "Say hi."}]
        client.chat.completions.create(model="policy", messages=hello)
        client.chat.completions.create(model="policy", messages=hello)  # a sibling: a retry
        before = state.store.get(session_id).stats()
        assert len(_trajectory(url, session_id)["trajectories"]) == 1  # drop_retries
        every = httpx.get(f"{url}/sessions/{session_id}/trajectory", params={"selection": "all"}).json()
        assert [t["checkpoint_ids"] for t in every["trajectories"]] == [[0], [1]]
        assert state.store.get(session_id).stats() == before  # reading changed nothing
        assert httpx.get(f"{url}/sessions/nope/trajectory").status_code == 404
        spec = httpx.get(f"{url}/openapi.json").json()
        route = spec["paths"]["/sessions/{session_id}/trajectory"]["get"]
        assert sorted(route["responses"]) == ["200", "404", "422"]
        assert set(spec["components"]["schemas"]["TrajectoryTokens"]["properties"]) >= {
            "prompt_ids",
            "response_ids",
            "loss_mask",
            "rollout_logprobs",
        }
