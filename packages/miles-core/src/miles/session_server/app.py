"""The session server: OpenAI-style chat completions over token-in, token-out engines.

    POST   /sessions                              create a session -> {id, base_url}
    GET    /sessions/{id}                         its state
    DELETE /sessions/{id}                         close it (its trajectory can still be read)
    POST   /sessions/{id}/v1/chat/completions     one turn

An agent points any OpenAI client at ``<server>/sessions/<id>/v1``. The server, not the
agent, decides the tokens: on the first turn it renders the model family's chat template;
after each completion the session records the prompt ids with the engine's output ids,
log-probs, weight versions and routed experts; a later turn extends the deepest
recorded checkpoint its messages replay and tokenizes only the new messages. Whatever
token-level fields the agent sends are ignored. Engines are reached through the
foundation's engine client (``/generate`` with ``input_ids``), so this works the same on
the embedded engine and on SGLang.

Every session sticks to one engine, chosen when it is created (the one with the fewest
live sessions), so each turn lands where its prefix already is.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse

from miles.errors import EngineError
from miles.families import FamilyError
from miles.session_server.openai_types import (
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    PromptTokensDetails,
    ResponseMessage,
    ToolCall,
    Usage,
)
from miles.sessions import (
    MessageError,
    SessionBusy,
    SessionClosed,
    SessionConflict,
    SessionError,
    SessionFull,
    SessionNotFound,
    SessionStore,
)
from miles.types import SamplingParams

_STATUS = {
    MessageError: 422,
    SessionNotFound: 404,
    SessionClosed: 410,
    SessionBusy: 409,
    SessionFull: 409,
    SessionConflict: 409,
}
SESSION_ID = Path(pattern=r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass
class ServerState:
    """What the server needs: the store, the family that owns tokens, the engines, default sampling."""

    store: SessionStore
    family: Any  # miles.families ModelFamily: render_ids, suffix_ids, parse_reply, stop_token_ids
    tokenizer: Any
    engines: list[Any]  # EngineClient (async)
    sampling: SamplingParams
    model_name: str = "policy"
    _engine_of: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def pin_engine(self, session_id: str) -> int:
        """A new session goes to the engine with the fewest live sessions and stays there."""
        with self._lock:
            load = [0] * len(self.engines)
            for index in self._engine_of.values():
                load[index] += 1
            chosen = min(range(len(self.engines)), key=lambda i: (load[i], i))
            self._engine_of[session_id] = chosen
            return chosen

    def engine_for(self, session_id: str) -> Any:
        with self._lock:
            if session_id not in self._engine_of:
                # A routed request must carry its key; a silent load-based fallback would break affinity.
                raise SessionNotFound(f"session {session_id!r} has no engine (it was never created here)")
            return self.engines[self._engine_of[session_id]]

    def release(self, session_id: str) -> None:
        with self._lock:
            self._engine_of.pop(session_id, None)


def _error(exc: Exception) -> JSONResponse:
    status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 400)
    body = {"error": {"message": str(exc), "type": getattr(exc, "code", type(exc).__name__)}}
    if getattr(exc, "index", None) is not None:
        body["error"]["message_index"] = exc.index  # type: ignore[attr-defined]
    return JSONResponse(status_code=status, content=body)


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for engine in state.engines:  # their HTTP sessions belong to this server's event loop
            close = getattr(engine, "aclose", None)
            if close is not None:
                await close()

    app = FastAPI(title="Miles session server", version="1", lifespan=lifespan)
    app.state.miles = state

    @app.exception_handler(SessionError)
    async def session_error(_: Request, exc: SessionError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(FamilyError)
    async def family_error(_: Request, exc: FamilyError) -> JSONResponse:
        # Raised while rendering the request's messages: the template cannot express them.
        return JSONResponse(status_code=422, content={"error": {"message": str(exc), "type": "unrenderable"}})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/sessions", status_code=201)
    async def create_session(request: Request) -> dict[str, Any]:
        session = state.store.create()
        engine = state.pin_engine(session.id)
        base = str(request.base_url).rstrip("/")
        return {"id": session.id, "base_url": f"{base}/sessions/{session.id}/v1", "engine": engine}

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str = SESSION_ID) -> dict[str, Any]:
        session = state.store.get(session_id)
        return {"id": session.id, **session.stats()}

    @app.delete("/sessions/{session_id}")
    async def delete_session(session_id: str = SESSION_ID) -> dict[str, Any]:
        state.store.delete(session_id)
        state.release(session_id)
        return {"id": session_id, "deleted": True}

    @app.post("/sessions/{session_id}/v1/chat/completions", response_model=ChatCompletion)
    async def chat_completions(body: ChatCompletionRequest, session_id: str = SESSION_ID) -> ChatCompletion:
        session = state.store.get(session_id)
        engine = state.engine_for(session_id)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        with session.turn(messages) as plan:
            if plan.parent is None:
                suffix = state.family.render_ids(state.tokenizer, messages, tools, add_generation_prompt=True)
                prefix: list[int] = []
            else:
                prefix = list(plan.prefix_ids)
                suffix = state.family.suffix_ids(
                    state.tokenizer,
                    [m.to_openai() for m in plan.new_messages],
                    tools,
                    add_generation_prompt=True,
                    previous=plan.parent.assistant.to_openai(),  # its tool calls shape the boundary
                    stop_id=prefix[-1] if prefix else None,
                )
            sampling = _sampling(state, body)
            try:
                out = await engine.generate(prefix + list(suffix), sampling)
            except EngineError as exc:
                raise HTTPException(status_code=502, detail=f"engine: {exc}") from exc
            reply = state.family.parse_reply(state.tokenizer, out.output_ids, tools=tools)
            finish = _finish_reason(out.finish_reason, reply)
            session.commit(
                plan,
                prompt_suffix_ids=suffix,
                output_ids=out.output_ids,
                output_logprobs=out.output_logprobs,
                weight_versions=out.token_versions(),
                finish_reason=finish,
                assistant_message=reply.to_message(),
                weight_version=out.weight_version,
                routed_experts=out.routed_experts,
            )
        prompt_tokens = len(prefix) + len(suffix)
        return ChatCompletion(
            model=body.model,
            choices=[
                Choice(
                    message=ResponseMessage(
                        content=reply.content,
                        reasoning_content=reply.reasoning_content,
                        tool_calls=[ToolCall.model_validate(c) for c in reply.tool_calls] or None,
                    ),
                    finish_reason=finish,
                )
            ],
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=len(out.output_ids),
                total_tokens=prompt_tokens + len(out.output_ids),
                prompt_tokens_details=PromptTokensDetails(cached_tokens=out.cached_tokens),
            ),
        )

    return app


def _sampling(state: ServerState, body: ChatCompletionRequest) -> SamplingParams:
    sampling = replace(state.sampling, stop_token_ids=list(state.family.stop_token_ids(state.tokenizer)))
    if body.temperature is not None:
        sampling.temperature = body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    if body.token_limit() is not None:
        # An agent may ask for fewer tokens than the run allows, never more.
        sampling.max_new_tokens = min(sampling.max_new_tokens, body.token_limit())  # type: ignore[arg-type]
    if body.seed is not None:
        sampling.seed = body.seed
    return sampling


def _finish_reason(engine_reason: str, reply: Any) -> str:
    if engine_reason == "length":
        return "length"
    if engine_reason == "abort":
        return "abort"
    return "tool_calls" if reply.tool_calls else "stop"
