"""The OpenAI chat-completions shapes the session server accepts and returns (the subset agents use).

Requests are validated strictly enough that a malformed body is a 422 with the field at
fault, never a 500; fields an OpenAI client may send but the server does not act on
(``user``, ``metadata``, ``store``, ...) are accepted and ignored. Token-level fields an
agent might send (``prompt_token_ids``, ``logprobs`` of its own) are never trusted: the
server decides the tokens.

The messages are validated one by one (``RequestMessages``), not with the body: an agent
resends its whole history every turn, and validating it again would make a turn cost grow
with the conversation. A message resent exactly as before keeps its validated form.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, ValidationError, field_validator

from miles_envs.sessions import MessageError
from miles_envs.sessions.messages import equal_prefix, frozen_json_object


class FunctionCall(BaseModel):
    name: str = Field(min_length=1)
    arguments: str = "{}"  # a JSON document, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json(cls, value: str) -> str:
        try:
            json.loads(value)
        except ValueError as err:
            raise ValueError(f"tool call arguments must be a JSON document: {err}") from None
        return value


class ToolCall(BaseModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise ValueError(
                        "content parts must be {'type': 'text', 'text': str} (no images or audio)"
                    )
        return value

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


# The integers a request may carry. The body decoder turns an integer beyond 64 bits into a float
# and pydantic takes a float as an int only inside int64, so a wider value would be a 422 that the
# schema did not announce; 64 bits is also what the engines keep a sampling seed in. The upper
# bound is exclusive because FastAPI writes schema bounds as floats: 2**63 - 1 would round up to
# 2**63 there, a value the server refuses; 2**63 and -2**63 are exact.
INT64_MIN, INT64_END = -(2**63), 2**63

# A request message as the client sent it (a JSON value, not validated with the body). The
# OpenAPI schema documents it as a ChatMessage; ``RequestMessages.validate`` enforces that.
RequestMessage = SkipValidation[ChatMessage]


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = "policy"
    messages: Annotated[list[RequestMessage], Field(min_length=1)]
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    temperature: float | None = Field(None, gt=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, lt=INT64_END, description="may lower the run's limit")
    max_completion_tokens: int | None = Field(
        None, ge=1, lt=INT64_END, description="may lower the run's limit"
    )
    n: Literal[1] = 1
    stream: Literal[False] = False
    seed: int | None = Field(None, ge=INT64_MIN, lt=INT64_END)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="the model family's thinking switch for this turn (e.g. enable_thinking, thinking, "
        "thinking_mode: whichever the family's template takes); over the run's default, per key; any other "
        "key is a 400",
    )

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def validate_message(raw: Any, index: int) -> dict[str, Any]:
    """One request message checked against ``ChatMessage``, as the dict the server works with.

    The dict holds the fields a chat template reads, with None values left out (defaults filled
    in: a tool call's ``type``, absent ``arguments`` as ``"{}"``). A bad message is a
    ``MessageError`` naming its index and every field at fault.
    """
    try:
        return ChatMessage.model_validate(raw).model_dump(exclude_none=True)
    except ValidationError as err:
        problems = "; ".join(f"{_field(e['loc'])}: {e['msg']}" for e in err.errors())
        raise MessageError(problems, index=index) from None


class RequestMessages:
    """Validates the messages of one session's requests, turn after turn (``validate_message``).

    A message sent exactly as at the same place in the previous request (the same JSON value)
    keeps its validated dict: the usual case, a history resent unchanged, costs one list
    comparison at C speed, and only the other messages are validated. Exact, because two equal
    plain JSON values differ at most in the type of a number (``1 == 1.0 == True``) and the
    validated dict holds no number: ``ChatMessage`` reads none, and the one part it keeps as sent,
    a list ``content``, is only reused when its parts hold nothing but strings.
    The dicts returned are shared between turns: read them, never edit them.
    """

    def __init__(self) -> None:
        # The previous request's messages, frozen (None: validate it again), and their dicts.
        self._keys: list[dict[str, Any] | None] = []
        self._validated: list[dict[str, Any]] = []

    def validate(self, raw: list[Any]) -> list[dict[str, Any]]:
        """The validated dicts of ``raw`` (the request's messages); ``MessageError`` if one is bad."""
        same = equal_prefix(raw, self._keys)
        keys, validated = self._keys[:same], self._validated[:same]
        for i in range(same, len(raw)):
            if i < len(self._keys) and raw[i] == self._keys[i]:
                keys.append(self._keys[i])
                validated.append(self._validated[i])
            else:
                validated.append(validate_message(raw[i], i))
                keys.append(_key(raw[i]))
        self._keys, self._validated = keys, validated
        return validated


def _key(raw: Any) -> dict[str, Any] | None:
    """What a later message must equal to reuse the validated form of ``raw`` (a valid message)."""
    key = frozen_json_object(raw)
    content = key.get("content") if key is not None else None
    if type(content) is list and not all(type(v) is str for part in content for v in part.values()):
        return None  # the parts are kept as sent: a number in them would make equality inexact
    return key


def _field(loc: tuple[int | str, ...]) -> str:
    """``("tool_calls", 0, "function")`` -> ``tool_calls[0].function``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "message"


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(
        description="the rule that refused the request, e.g. session_not_found, history_diverged"
    )
    message_index: int | None = Field(None, description="the request message at fault, when there is one")


class ErrorResponse(BaseModel):
    """The body of every error the server answers itself (400, 404, 409, 410, 422, 502)."""

    error: ErrorDetail


class ValidationIssue(BaseModel):
    model_config = ConfigDict(extra="allow")  # FastAPI adds input and ctx where pydantic has them

    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorResponse(BaseModel):
    """FastAPI's 422 body for a request that does not match the schema (before any handler runs)."""

    detail: list[ValidationIssue]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TrajectoryTokens(BaseModel):
    """One training sequence of a session, as the trainer receives it (``miles_envs.sessions.assemble``)."""

    leaf: int = Field(description="the id of the checkpoint it ends at")
    checkpoint_ids: list[int] = Field(description="its checkpoints, root first (one per generated turn)")
    prompt_ids: list[int] = Field(description="the first turn's rendered prompt")
    response_ids: list[int] = Field(
        description="every later token: each turn's output, then the next turn's appended suffix"
    )
    loss_mask: list[int] = Field(
        description="per response token: 1 where the model sampled it and it is trained, else 0"
    )
    rollout_logprobs: list[float] = Field(
        description="per response token: the engine's log-prob (0.0 where masked)"
    )
    weight_versions: list[int] = Field(
        description="per response token: the weight version it was sampled under"
    )
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]
    status: Literal["completed", "truncated", "aborted", "failed"]


class SessionTrajectories(BaseModel):
    """``GET /sessions/{id}/trajectory``: a linear session has one trajectory, a branching one one per leaf."""

    id: str
    mode: Literal["linear", "branching"]
    trajectories: list[TrajectoryTokens]


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
