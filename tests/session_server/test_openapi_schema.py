"""The session server's OpenAPI schema tells the truth: every status a route answers is documented
with the body it really sends, and every value the schema allows is accepted (never a 422).

The answers come from a live server in front of a real embedded engine, and the schema is the one
the server publishes at ``/openapi.json``: what an OpenAI-style client or a fuzzer reads.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from miles.engines.launchers import free_port
from session_server.conftest import session_server

# schemathesis brings jsonschema in the dev environment; a machine without it (the GPU one) skips.
jsonschema = pytest.importorskip("jsonschema")

CHAT = "/sessions/{session_id}/v1/chat/completions"
TRAJECTORY = "/sessions/{session_id}/trajectory"
HELLO = [{"role": "user", "content": "Say hi."}]


def _check_documented(spec: dict[str, Any], path: str, method: str, response: httpx.Response) -> None:
    """``response`` is one of the answers ``spec`` documents for the route, with a body of its schema."""
    documented = spec["paths"][path][method]["responses"]
    code = str(response.status_code)
    assert code in documented, f"{method.upper()} {path} answered {code}, documented: {sorted(documented)}"
    schema = documented[code]["content"]["application/json"]["schema"]
    # The refs point into the spec's components; resolve them against a root that carries them.
    jsonschema.validate(response.json(), {**schema, "components": spec["components"]})


def test_the_schema_lists_every_status_each_route_answers(qwen3, engine_url):
    with session_server(qwen3, engine_url) as (url, _):
        spec = httpx.get(f"{url}/openapi.json").json()
    codes = {
        (path, method): sorted(op["responses"])
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
    }
    assert codes == {
        ("/health", "get"): ["200"],
        ("/sessions", "post"): ["201", "409"],
        ("/sessions/{session_id}", "get"): ["200", "404", "422"],
        ("/sessions/{session_id}", "delete"): ["200", "404", "422"],
        (TRAJECTORY, "get"): ["200", "404", "422"],
        (CHAT, "post"): ["200", "400", "404", "409", "410", "422", "502"],
    }


def test_every_error_the_server_answers_is_documented_with_its_body(qwen3, engine_url):
    with session_server(qwen3, engine_url) as (url, state):
        spec = httpx.get(f"{url}/openapi.json").json()
        seen: set[tuple[str, str, int]] = set()

        def check(path: str, method: str, response: httpx.Response) -> httpx.Response:
            _check_documented(spec, path, method, response)
            seen.add((path, method, response.status_code))
            return response

        sid = check("/sessions", "post", httpx.post(f"{url}/sessions")).json()["id"]
        chat = f"{url}/sessions/{sid}/v1/chat/completions"
        reply = check(CHAT, "post", httpx.post(chat, json={"messages": HELLO})).json()["choices"][0][
            "message"
        ]
        history = [*HELLO, reply, {"role": "user", "content": "More."}]
        assert check(CHAT, "post", httpx.post(chat, json={"messages": history})).status_code == 200
        # Rewriting an earlier turn does not extend this linear session.
        forged = [{"role": "user", "content": "Something else."}, *history[1:]]
        assert check(CHAT, "post", httpx.post(chat, json={"messages": forged})).status_code == 409
        bad_message = check(
            CHAT, "post", httpx.post(chat, json={"messages": [{"role": "user", "content": 3}]})
        )
        assert bad_message.status_code == 422 and bad_message.json()["error"]["type"] == "bad_message"
        assert check(CHAT, "post", httpx.post(chat, json={"messages": HELLO, "n": 2})).status_code == 422
        foreign = {"messages": history, "chat_template_kwargs": {"thinking_mode": "disabled"}}
        wrong_switch = check(CHAT, "post", httpx.post(chat, json=foreign))
        assert wrong_switch.status_code == 400
        assert wrong_switch.json()["error"]["type"] == "invalid_chat_template_kwargs"
        assert check(TRAJECTORY, "get", httpx.get(f"{url}/sessions/{sid}/trajectory")).status_code == 200
        assert (
            check("/sessions/{session_id}", "get", httpx.get(f"{url}/sessions/{'x' * 129}")).status_code
            == 422
        )
        state.max_seq_len = 3  # shorter than any prompt: the turn cannot run
        exhausted = check(CHAT, "post", httpx.post(chat, json={"messages": history}))
        assert exhausted.status_code == 400 and exhausted.json()["error"]["type"] == "context_length_exceeded"
        # With no limit of its own, the server passes the engine's refusal of a prompt longer than the
        # model's context (HTTP 400 there) on as the request's fault: 400, not an engine failure.
        state.max_seq_len = None
        fresh = httpx.post(f"{url}/sessions").json()["id"]
        too_long = {"messages": [{"role": "user", "content": " hello" * 5000}]}
        rejected = check(
            CHAT, "post", httpx.post(f"{url}/sessions/{fresh}/v1/chat/completions", json=too_long, timeout=60)
        )
        assert rejected.status_code == 400, rejected.text
        assert rejected.json()["error"]["type"] == "engine_rejected_request"
        assert "context" in rejected.json()["error"]["message"]
        state.store.max_sessions = len(state.store)
        assert check("/sessions", "post", httpx.post(f"{url}/sessions")).status_code == 409
        assert (
            check("/sessions/{session_id}", "delete", httpx.delete(f"{url}/sessions/{sid}")).status_code
            == 200
        )
        for method in ("get", "delete"):
            gone = httpx.request(method.upper(), f"{url}/sessions/{sid}")
            assert check("/sessions/{session_id}", method, gone).status_code == 404
        assert check(TRAJECTORY, "get", httpx.get(f"{url}/sessions/{sid}/trajectory")).status_code == 404
        assert check(CHAT, "post", httpx.post(chat, json={"messages": HELLO})).status_code == 404
    # An engine that cannot be reached is a 502 with the same error body.
    with session_server(qwen3, f"http://127.0.0.1:{free_port()}") as (url, _):
        sid = httpx.post(f"{url}/sessions").json()["id"]
        failed = httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json={"messages": HELLO}, timeout=60)
        check(CHAT, "post", failed)
        assert failed.status_code == 502 and failed.json()["error"]["type"] == "engine_error"
    assert {code for path, _, code in seen if path == CHAT} == {200, 400, 404, 409, 422, 502}


def _bounds(spec: dict[str, Any], field: str) -> tuple[int, int]:
    """The smallest and largest integer the published schema allows for a request field."""
    [schema] = [
        s
        for s in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"][field]["anyOf"]
        if s.get("type") == "integer"
    ]
    assert "minimum" in schema and ("maximum" in schema or "exclusiveMaximum" in schema), (field, schema)
    high = int(schema["maximum"]) if "maximum" in schema else int(schema["exclusiveMaximum"]) - 1
    return int(schema["minimum"]), high


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "seed"])
def test_schema_valid_extremes_are_accepted_and_the_next_values_are_not(qwen3, engine_url, field):
    with session_server(qwen3, engine_url, mode="branching") as (url, _):
        spec = httpx.get(f"{url}/openapi.json").json()
        low, high = _bounds(spec, field)
        sid = httpx.post(f"{url}/sessions").json()["id"]
        chat = f"{url}/sessions/{sid}/v1/chat/completions"
        for value in (low, high):
            answer = httpx.post(chat, json={"messages": HELLO, field: value}, timeout=60)
            assert answer.status_code == 200, (field, value, answer.text)
        for value in (low - 1, high + 1):
            answer = httpx.post(chat, json={"messages": HELLO, field: value}, timeout=60)
            assert answer.status_code == 422, (field, value, answer.text)
            _check_documented(spec, CHAT, "post", answer)
