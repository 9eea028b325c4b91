"""The session server: OpenAI-style chat completions over token-in, token-out engines.

    POST   /sessions                              create a session -> {id, base_url}
    GET    /sessions/{id}                         its state
    GET    /sessions/{id}/trajectory              its assembled tokens, loss mask and log-probs (read-only)
    DELETE /sessions/{id}                         close it (its trajectory can still be read)
    POST   /sessions/{id}/v1/chat/completions     one turn

An agent points any OpenAI client at ``<server>/sessions/<id>/v1``. The server, not the
agent, decides the tokens: on the first turn it renders the model family's chat template;
after each completion the session records the prompt ids with the engine's output ids,
log-probs, weight versions and routed experts; a later turn extends the deepest
recorded checkpoint its messages replay and tokenizes only the new messages. Whatever
token-level fields the agent sends are ignored. Engines are reached through the
foundation's engine client (``/generate`` with ``input_ids``), so this works the same on
the embedded engine and on SGLang. The turn itself is :func:`miles_envs.session_server.turns.complete_turn`,
shared with the in-process multi-turn rollout.

Every session sticks to one engine (and data-parallel rank), chosen by the router when it is
created (the one with the fewest active requests), so each turn lands where its prefix
already is and the engine's prefix cache serves it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from miles.engines.router import Router
from miles.errors import EngineError, EngineRejected
from miles.interfaces import EngineClient
from miles.types import GenerateOutput, Prompt, SamplingParams, Status
from miles_envs.families import FamilyError
from miles_envs.families.base import TemplateKwargsError, Thinking
from miles_envs.session_server.openai_types import (
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ErrorResponse,
    PromptTokensDetails,
    RequestMessages,
    ResponseMessage,
    SessionTrajectories,
    ToolCall,
    TrajectoryTokens,
    Usage,
    ValidationErrorResponse,
)
from miles_envs.session_server.turns import ContextExhausted, complete_turn
from miles_envs.sessions import (
    MessageError,
    Session,
    SessionBusy,
    SessionClosed,
    SessionConflict,
    SessionError,
    SessionFull,
    SessionNotFound,
    SessionStore,
    session_samples,
)

_STATUS = {
    MessageError: 422,
    SessionNotFound: 404,
    SessionClosed: 410,
    SessionBusy: 409,
    SessionFull: 409,
    SessionConflict: 409,
}
SESSION_ID = Path(pattern=r"^[A-Za-z0-9_.-]{1,128}$")
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorResponse,
        "description": "the turn cannot run (context_length_exceeded), or chat_template_kwargs the model "
        "family's template does not take (invalid_chat_template_kwargs)",
    },
    404: {"model": ErrorResponse, "description": "unknown session"},
    409: {"model": ErrorResponse, "description": "the request does not extend the session, or it is full"},
    410: {"model": ErrorResponse, "description": "the session was deleted while the request was generating"},
    # Two shapes: FastAPI's for a body that does not match the schema, ours for a message the
    # server checks itself (bad_message) or the template cannot render (unrenderable).
    422: {"model": ErrorResponse | ValidationErrorResponse, "description": "malformed request"},
    502: {"model": ErrorResponse, "description": "the engine failed"},
}


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give, for its OpenAPI schema (clients and fuzzers read it)."""
    return {code: _ERRORS[code] for code in codes}


@dataclass
class SessionUsage:
    """What a session's turns cost: prompt tokens sent, how many the engine's prefix cache served,
    and whether the session ran out of tokens (``max_seq_len``)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    exhausted: bool = False


@dataclass
class ServerState:
    """What the server needs: the store, the family that owns tokens, the engines, default sampling.

    ``router`` keeps each session on the engine (and data-parallel rank) that holds its prefix:
    the session id is the routing key, bound when the session is created (the engine with the
    fewest active requests) and forgotten when it is deleted. ``max_seq_len`` caps a
    session's prompt plus replies; a session that reached it is remembered as exhausted, so
    its trajectory is reported truncated. ``chat_template_kwargs`` is the run's default thinking
    switch (``agentic.chat_template_kwargs``); a request's own ``chat_template_kwargs`` override
    it key by key. Only the family's own switch is accepted (``ModelFamily.request_thinking``).
    """

    store: SessionStore
    family: Any  # miles_envs.families ModelFamily: render_ids, suffix_ids, parse_reply, stop_token_ids
    tokenizer: Any
    engines: list[EngineClient]  # the engine kind's clients (async)
    sampling: SamplingParams
    model_name: str = "policy"
    max_seq_len: int | None = None
    router: Router | None = None  # default: affinity routing over ``engines``
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # Ask the engines for MoE routing and record it with every turn (a run that records routing).
    return_routed_experts: bool = False
    _usage: dict[str, SessionUsage] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.router is None:
            self.router = Router(self.engines)
        if self.chat_template_kwargs:  # a bad default fails here, not at every turn
            self.family.request_thinking(self.chat_template_kwargs)

    def thinking(self, request_kwargs: Mapping[str, Any] | None) -> Thinking:
        """The thinking switch of one turn: the request's chat_template_kwargs over the run's default."""
        kwargs = {**self.chat_template_kwargs, **(request_kwargs or {})}
        return self.family.request_thinking(kwargs) if kwargs else None

    @property
    def routes(self) -> Router:
        """``router``, which ``__post_init__`` always sets."""
        assert self.router is not None
        return self.router

    def place(self, session_id: str) -> int:
        """Bind a new session to an engine (the least active); returns the engine's index."""
        return self.routes.route(session_id, sticky=True).engine_index

    def record(
        self, session_id: str, *, prompt_tokens: int = 0, cached_tokens: int = 0, exhausted: bool = False
    ) -> None:
        """Count a turn's tokens (or that the session ran out of them) towards its usage."""
        with self._lock:
            usage = self._usage.setdefault(session_id, SessionUsage())
            usage.prompt_tokens += prompt_tokens
            usage.cached_tokens += cached_tokens
            usage.exhausted |= exhausted

    def usage(self, session_id: str) -> SessionUsage:
        """A copy of a live session's usage so far."""
        with self._lock:
            return replace(self._usage.get(session_id) or SessionUsage())

    def release(self, session_id: str) -> SessionUsage:
        """Forget a deleted session's routing; returns its usage (tokens, and whether it ran out)."""
        self.routes.forget(session_id)
        with self._lock:
            return self._usage.pop(session_id, SessionUsage())


class _OrjsonRequest(Request):
    """A request whose JSON body is decoded with orjson (about 2x faster than ``json.loads``).

    An agent resends its whole conversation every turn, so decoding the body is the one part of
    a turn whose cost grows with the history. ``orjson.JSONDecodeError`` subclasses
    ``json.JSONDecodeError``, so a malformed body is still FastAPI's 422.
    """

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class _OrjsonRoute(APIRoute):
    """Routes that hand their endpoint an :class:`_OrjsonRequest` (FastAPI's custom-route hook)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return route


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
    app.router.route_class = _OrjsonRoute
    app.state.miles = state
    # Per session, its requests' validated messages (so a resent history is not validated again);
    # dropped with the session.
    request_messages: weakref.WeakKeyDictionary[Session, RequestMessages] = weakref.WeakKeyDictionary()

    @app.exception_handler(SessionError)
    async def session_error(_: Request, exc: SessionError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError) -> JSONResponse:
        # Only a turn reaches an engine; the agent's request was fine, the engine behind it was not.
        return JSONResponse(
            status_code=502, content={"error": {"message": f"engine: {exc}", "type": "engine_error"}}
        )

    @app.exception_handler(EngineRejected)
    async def engine_rejected(_: Request, exc: EngineRejected) -> JSONResponse:
        # The engine refused this turn as the agent's request made it (e.g. a conversation longer
        # than the model's context): the request's fault, answered 400 with the engine's reason.
        return JSONResponse(
            status_code=400,
            content={"error": {"message": f"engine: {exc}", "type": "engine_rejected_request"}},
        )

    @app.exception_handler(TemplateKwargsError)
    async def template_kwargs_error(_: Request, exc: TemplateKwargsError) -> JSONResponse:
        # The request asks for a template variable this family's template does not take.
        return JSONResponse(
            status_code=400, content={"error": {"message": str(exc), "type": "invalid_chat_template_kwargs"}}
        )

    @app.exception_handler(FamilyError)
    async def family_error(_: Request, exc: FamilyError) -> JSONResponse:
        # Raised while rendering the request's messages: the template cannot express them.
        return JSONResponse(status_code=422, content={"error": {"message": str(exc), "type": "unrenderable"}})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/sessions", status_code=201, responses=_responses(409))
    async def create_session(request: Request) -> dict[str, Any]:
        session = state.store.create()
        engine = state.place(session.id)
        base = str(request.base_url).rstrip("/")
        return {"id": session.id, "base_url": f"{base}/sessions/{session.id}/v1", "engine": engine}

    @app.get("/sessions/{session_id}", responses=_responses(404, 422))
    async def get_session(session_id: str = SESSION_ID) -> dict[str, Any]:
        session = state.store.get(session_id)
        return {"id": session.id, **session.stats()}

    @app.get(
        "/sessions/{session_id}/trajectory",
        response_model=SessionTrajectories,
        responses=_responses(404, 422),
    )
    async def get_trajectory(
        session_id: str = SESSION_ID,
        selection: Literal["drop_retries", "all"] = Query(
            "drop_retries", description="branching sessions: which leaves (as agentic.leaf_selection)"
        ),
    ) -> SessionTrajectories:
        """The tokens the trainer gets from this session so far (read-only; nothing is changed)."""
        session = state.store.get(session_id)
        exhausted = state.usage(session_id).exhausted
        samples = session_samples(session, Prompt(index=0, prompt=""), selection=selection)
        return SessionTrajectories(
            id=session.id,
            mode=session.mode,
            trajectories=[
                TrajectoryTokens(
                    leaf=sample.metadata["leaf"],
                    checkpoint_ids=sample.metadata["checkpoint_ids"],
                    prompt_ids=sample.prompt_ids,
                    response_ids=sample.response_ids,
                    loss_mask=sample.loss_mask,
                    rollout_logprobs=sample.rollout_logprobs,
                    weight_versions=sample.weight_versions,
                    finish_reason=sample.metadata["finish_reason"],  # the last turn's (always set)
                    status=(
                        Status.TRUNCATED if exhausted and sample.status is Status.COMPLETED else sample.status
                    ).value,
                )
                for sample in samples
            ],
        )

    @app.delete("/sessions/{session_id}", responses=_responses(404, 422))
    async def delete_session(session_id: str = SESSION_ID) -> dict[str, Any]:
        state.store.delete(session_id)
        state.release(session_id)
        return {"id": session_id, "deleted": True}

    @app.post(
        "/sessions/{session_id}/v1/chat/completions",
        response_model=ChatCompletion,
        responses=_responses(400, 404, 409, 410, 422, 502),
    )
    async def chat_completions(body: ChatCompletionRequest, session_id: str = SESSION_ID) -> ChatCompletion:
        session = state.store.get(session_id)
        if session not in request_messages:
            request_messages[session] = RequestMessages()
        messages = request_messages[session].validate(body.messages)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        thinking = state.thinking(body.chat_template_kwargs)  # TemplateKwargsError: 400

        async def generate(input_ids: list[int], sampling: SamplingParams) -> GenerateOutput:
            # The session id is the routing key: every turn goes where its prefix is. An
            # EngineError is answered 502 (``engine_error``), EngineRejected 400.
            async with state.routes.request(session_id, sticky=True) as route:
                if state.return_routed_experts:
                    return await route.generate(input_ids, sampling, return_routed_experts=True)
                return await route.generate(input_ids, sampling)

        try:
            turn = await complete_turn(
                session,
                messages,
                tools,
                family=state.family,
                tokenizer=state.tokenizer,
                generate=generate,
                sampling=_sampling(state, body),
                max_seq_len=state.max_seq_len,
                enable_thinking=thinking,
            )
        except ContextExhausted:
            state.record(session_id, exhausted=True)
            raise
        state.record(session_id, prompt_tokens=turn.prompt_tokens, cached_tokens=turn.cached_tokens)
        reply = turn.reply
        return ChatCompletion(
            model=body.model,
            choices=[
                Choice(
                    message=ResponseMessage(
                        content=reply.content,
                        reasoning_content=reply.reasoning_content,
                        tool_calls=[ToolCall.model_validate(c) for c in reply.tool_calls] or None,
                    ),
                    finish_reason=turn.finish_reason,
                )
            ],
            usage=Usage(
                prompt_tokens=turn.prompt_tokens,
                completion_tokens=turn.completion_tokens,
                total_tokens=turn.prompt_tokens + turn.completion_tokens,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=turn.cached_tokens),
            ),
        )

    return app


def _sampling(state: ServerState, body: ChatCompletionRequest) -> SamplingParams:
    sampling = replace(state.sampling)  # the turn adds the family's stop tokens
    if body.temperature is not None:
        sampling.temperature = body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    token_limit = body.token_limit()
    if token_limit is not None:
        # An agent may ask for fewer tokens than the run allows, never more.
        sampling.max_new_tokens = min(sampling.max_new_tokens, token_limit)
    if body.seed is not None:
        sampling.seed = body.seed
    return sampling
