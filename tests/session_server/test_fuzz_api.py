"""Property-based fuzzing of the session server's HTTP API from its own OpenAPI schema: no 5xx, ever,
and every answer is one the schema documents (its status code, and a body of that status's schema)."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from session_server.conftest import session_server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def api_schema(qwen3, engine_url):
    """The schema of a live server (over HTTP: its engine client lives on the server's own loop)."""
    with session_server(qwen3, engine_url, mode="branching", max_new_tokens=4) as (url, state):
        # A session that exists, so the fuzzer also reaches the chat endpoint behind a valid id.
        state.place(state.store.create(session_id="fuzz").id)
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


def test_no_server_errors_on_any_input(api_schema):
    from hypothesis import given
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import response_schema_conformance, status_code_conformance

    operations = [result.ok() for result in api_schema.get_all_operations()]
    chat = next(op for op in operations if op.path.endswith("/chat/completions"))
    strategies = [op.as_strategy(mode) for op in operations for mode in GenerationMode]
    # Behind a session that exists, so valid and invalid bodies reach the handler and the engine.
    strategies += [chat.as_strategy(mode, path_parameters={"session_id": "fuzz"}) for mode in GenerationMode]
    seen: list[tuple[str, int]] = []

    @given(st.one_of(strategies))
    @settings(
        max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate]
    )
    def call(case):
        try:
            response = case.call(timeout=30)
        except Exception as exc:
            raise AssertionError(f"{case.method} {case.formatted_path} {case.body!r:.2000}: {exc}") from None
        seen.append((case.formatted_path, response.status_code))
        assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text[:500])
        case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])

    call()
    chat_codes = {code for path, code in seen if path == "/sessions/fuzz/v1/chat/completions"}
    assert 200 in chat_codes and 422 in chat_codes, chat_codes
