"""Request messages are validated one by one, and a resent one only when it changed.

The chat route no longer validates the whole history inside the body model: ``RequestMessages``
validates each message against ``ChatMessage`` and keeps the result for a message resent as the
same JSON value. These tests pin that the validated form is exactly what the body model made,
that nothing stale is ever returned, and that the schema still documents the messages.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest

from miles.types import SamplingParams
from miles_envs.session_server.app import ServerState, create_app
from miles_envs.session_server.openai_types import ChatMessage, RequestMessages, validate_message
from miles_envs.sessions import MessageError, SessionStore
from session_server.conftest import session_server


def call(call_id: str, arguments: str | None = '{"q": "x"}') -> dict[str, Any]:
    function: dict[str, Any] = {"name": "search"}
    if arguments is not None:
        function["arguments"] = arguments
    return {"id": call_id, "type": "function", "function": function}


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Find "}, {"type": "text", "text": "X."}]},
    {"role": "assistant", "content": None, "tool_calls": [call("c1", None)], "refusal": None},
    {"role": "tool", "tool_call_id": "c1", "content": "found", "name": None},
]


def decoded(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the next request's JSON decodes to: equal values, new objects."""
    return json.loads(json.dumps(messages))


def test_validated_dicts_are_what_the_body_model_made() -> None:
    expected = [ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in HISTORY]
    assert RequestMessages().validate(decoded(HISTORY)) == expected
    # Defaults filled in, None values left out, keys a template does not read dropped.
    assert expected[2] == {"role": "assistant", "tool_calls": [call("c1", "{}")]}


def test_a_resent_message_keeps_its_validated_form_and_a_changed_one_is_validated_again() -> None:
    cache = RequestMessages()
    first = cache.validate(decoded(HISTORY))
    resent = decoded(HISTORY)
    resent[3]["content"] = "found, twice"
    second = cache.validate([*resent, {"role": "user", "content": "go on"}])
    assert all(second[i] is first[i] for i in range(3))  # reused, not validated again
    assert second[3] is not first[3] and second[3]["content"] == "found, twice"
    assert second[4] == {"role": "user", "content": "go on"}


def test_a_bad_message_names_its_index_and_fields_and_leaves_the_cache_as_it_was() -> None:
    cache = RequestMessages()
    first = cache.validate(decoded(HISTORY))
    bad = decoded(HISTORY)
    bad[2]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(MessageError) as err:
        cache.validate([*bad, {"role": "robot"}])
    assert err.value.index == 2
    assert "tool_calls[0].function.arguments" in str(err.value) and "JSON" in str(err.value)
    again = cache.validate(decoded(HISTORY))
    assert all(a is b for a, b in zip(again, first, strict=True))
    with pytest.raises(MessageError) as err:
        cache.validate([*decoded(HISTORY), {"role": "robot"}])
    assert err.value.index == 4 and "role" in str(err.value)


@pytest.mark.parametrize("later", [True, 1.0])
def test_content_parts_holding_numbers_are_never_reused(later: object) -> None:
    # 1 == 1.0 == True in Python; the parts are kept as sent, so reusing would return a stale value.
    cache = RequestMessages()
    message = {"role": "user", "content": [{"type": "text", "text": "x", "weight": 1}]}
    cache.validate([message])
    changed = copy.deepcopy(message)
    changed["content"][0]["weight"] = later
    [validated] = cache.validate([changed])
    assert type(validated["content"][0]["weight"]) is type(later)


def test_validate_message_is_the_one_message_check() -> None:
    assert validate_message({"role": "user", "content": "hi"}, 0) == {"role": "user", "content": "hi"}
    for bad in (None, "hi", {"role": "user", "content": [{"type": "image_url"}]}, {"content": "no role"}):
        with pytest.raises(MessageError) as err:
            validate_message(bad, 7)
        assert err.value.index == 7


def test_bodies_are_decoded_with_orjson_and_bad_json_is_still_a_422() -> None:
    import asyncio

    from miles.engines.client import SGLangClient

    state = ServerState(
        store=SessionStore(),
        family=None,
        tokenizer=None,
        engines=[SGLangClient("http://127.0.0.1:9")],  # never reached: every body here is refused
        sampling=SamplingParams(),
    )
    state.store.create(session_id="s")
    app = create_app(state)

    async def post(content: bytes) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            headers = {"content-type": "application/json"}
            return await http.post("/sessions/s/v1/chat/completions", content=content, headers=headers)

    for body in (b'{"messages": [', b'{"messages": NaN}', b'{"model": 1' + b"0" * 30 + b"}", b"\xff"):
        answer = asyncio.run(post(body))
        assert answer.status_code == 422, (body, answer.text)
    api = {route.path: type(route).__name__ for route in app.routes if route.path.startswith("/sessions")}
    assert set(api.values()) == {"_OrjsonRoute"} and "/sessions/{session_id}/v1/chat/completions" in api


def test_the_schema_still_documents_every_message() -> None:
    from miles.engines.client import SGLangClient

    unused = SGLangClient("http://127.0.0.1:9")  # building the schema contacts no engine
    state = ServerState(
        store=SessionStore(), family=None, tokenizer=None, engines=[unused], sampling=SamplingParams()
    )
    schemas = create_app(state).openapi()["components"]["schemas"]
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["type"] == "array" and messages["minItems"] == 1
    item = messages["items"]  # the ChatMessage schema, inlined
    assert item["title"] == "ChatMessage" and item["required"] == ["role"]
    assert item["properties"] == schemas["ChatMessage"]["properties"]
    assert set(item["properties"]["role"]["enum"]) == {"system", "developer", "user", "assistant", "tool"}


@pytest.mark.slow
def test_over_http_resent_histories_are_checked_like_new_ones(qwen3, engine_url):
    from session_server.conftest import session_server

    with session_server(qwen3, engine_url) as (url, _):
        created = httpx.post(f"{url}/sessions").json()
        chat = f"{created['base_url']}/chat/completions"
        history: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
        for turn in range(3):
            response = httpx.post(chat, json={"messages": history})
            assert response.status_code == 200, response.text
            reply = response.json()["choices"][0]["message"]
            # The agent's copy of the reply carries token fields of its own: ignored, every turn.
            history += [
                {**reply, "prompt_token_ids": [turn], "logprobs": None},
                {"role": "user", "content": "Again."},
            ]
        # A bad new message after a recognised history is still a 422 that names it.
        bad = httpx.post(chat, json={"messages": [*history[:-1], {"role": "user", "content": 3}]})
        assert bad.status_code == 422 and bad.json()["error"]["message_index"] == len(history) - 1
        # Rewriting a recognised earlier message is still refused by the linear session.
        forged = copy.deepcopy(history)
        forged[1]["content"] = "Bye"
        refused = httpx.post(chat, json={"messages": forged})
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "history_diverged"
        assert refused.json()["error"]["message_index"] == 1
        assert httpx.post(chat, json={"messages": history}).status_code == 200


def test_a_taken_port_is_one_clear_error_and_port_zero_keeps_the_port_it_was_given(qwen3):
    import socket

    # No engine is contacted: the server only has to bind.
    with session_server(qwen3, "http://127.0.0.1:9") as (url, state):
        port = int(url.rsplit(":", 1)[1])
        assert port > 0
        with socket.socket() as probe, pytest.raises(OSError):
            probe.bind(("127.0.0.1", port))  # the server still holds the port it was given
        from miles_envs.session_server.serve import serve

        with pytest.raises(RuntimeError, match=rf"cannot bind 127\.0\.0\.1:{port}"), serve(state, port=port):
            pass
