"""The normalised chat message the session store records and compares.

An OpenAI-style message carries many keys; a chat template reads only a few. A message is
reduced to exactly those (role, content, reasoning content, tool calls, tool-call id,
name), so keys that a client library adds on its own (``refusal``, ``annotations``, a tool
call's ``index``...) can never make a replayed message look different. Empty values are
normalised (``None``, ``""`` and ``[]`` content are one empty string; a missing tool-call
list is an empty tuple), because harnesses disagree on which of them to send.

Parsing is the one place where a malformed message is refused (``MessageError``), so the
matchers and the store work on well-formed values only.

Agents resend their whole history every turn. ``replay_key`` makes a frozen copy of a message
as sent, which a later request's message can be compared with (``==``, at C speed) to recognise
the very same JSON value without parsing it again; the session store uses it to keep the cost
of a turn flat in the length of the conversation (see ``miles_envs.sessions.store``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_envs.sessions.errors import MessageError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# How deeply a message may nest to get a replay key. Real messages nest about 4 levels; the bound
# keeps both the copy and the later ``==`` (recursive in C) far from the interpreter's stack limit.
MAX_KEY_DEPTH = 16

# Tool-call arguments as the client sent them: normally a JSON string; some harnesses send
# the decoded object. Absent arguments are the empty string.
Arguments = str | dict[str, Any] | list[Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call of an assistant message."""

    name: str
    arguments: Arguments = ""
    id: str | None = None
    type: str = "function"

    @classmethod
    def from_openai(cls, raw: Any, *, where: str = "tool call") -> ToolCall:
        """Parse ``{"id", "type", "function": {"name", "arguments"}}`` (the wire-only ``index`` is dropped)."""
        if not isinstance(raw, Mapping):
            raise MessageError(f"{where} must be an object, got {type(raw).__name__}")
        function = raw.get("function")
        if not isinstance(function, Mapping):
            raise MessageError(f"{where} has no 'function' object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise MessageError(f"{where}: function.name must be a non-empty string, got {name!r}")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = ""
        if not isinstance(arguments, str | dict | list):
            raise MessageError(
                f"{where}: function.arguments must be a JSON string (or an object), got {type(arguments).__name__}"
            )
        call_id = _optional_str(raw.get("id"), f"{where}: id")
        call_type = raw.get("type") or "function"
        if not isinstance(call_type, str):
            raise MessageError(f"{where}: type must be a string, got {call_type!r}")
        return cls(name=name, arguments=arguments, id=call_id, type=call_type)

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if self.id is not None:
            out["id"] = self.id
        return out


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message, reduced to the fields a chat template reads.

    ``content`` is a string, or a tuple of text parts when the client sent a list of
    ``{"type": "text"}`` parts (kept apart from a string because templates may render the
    two differently).
    """

    role: str
    content: str | tuple[str, ...] = ""
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = field(default=())
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The visible text: the content, with text parts joined."""
        return self.content if isinstance(self.content, str) else "".join(self.content)

    @classmethod
    def from_openai(cls, raw: Any, *, index: int | None = None) -> Message:
        """Parse one OpenAI-style message dict; unknown keys are ignored, bad values refused."""
        if isinstance(raw, Message):
            return raw
        if not isinstance(raw, Mapping):
            raise MessageError(f"must be an object, got {type(raw).__name__}", index=index)
        try:
            return cls._parse(raw)
        except MessageError as err:
            if index is None:
                raise
            raise MessageError(str(err), index=index) from None

    @classmethod
    def _parse(cls, raw: Mapping[str, Any]) -> Message:
        role = raw.get("role")
        if role not in ROLES:
            raise MessageError(f"role must be one of {', '.join(sorted(ROLES))}; got {role!r}")
        content = _parse_content(raw.get("content"))
        reasoning = raw.get("reasoning_content")
        if reasoning is None:
            reasoning = raw.get("reasoning")  # the name some servers and SDKs use
        reasoning = _optional_str(reasoning, "reasoning_content")
        raw_calls = raw.get("tool_calls") or []
        if not isinstance(raw_calls, list | tuple):
            raise MessageError(f"tool_calls must be a list, got {type(raw_calls).__name__}")
        if raw_calls and role != "assistant":
            raise MessageError(f"only assistant messages carry tool_calls (this one is {role!r})")
        calls = tuple(ToolCall.from_openai(c, where=f"tool_calls[{i}]") for i, c in enumerate(raw_calls))
        return cls(
            role=role,
            content=content,
            reasoning_content=reasoning,
            tool_calls=calls,
            tool_call_id=_optional_str(raw.get("tool_call_id"), "tool_call_id"),
            name=_optional_str(raw.get("name"), "name"),
        )

    def to_openai(self) -> dict[str, Any]:
        """The message as a dict for a chat template (only the fields that are set)."""
        out: dict[str, Any] = {"role": self.role}
        if isinstance(self.content, str):
            out["content"] = self.content
        else:
            out["content"] = [{"type": "text", "text": t} for t in self.content]
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def message_list(raw: Any) -> list[Any]:
    """A request's messages as a list, not parsed yet; anything but a sequence of them is refused."""
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise MessageError(f"messages must be a list of message objects, got {type(raw).__name__}")
    return list(raw)


def parse_messages(raw: Any) -> tuple[Message, ...]:
    """Parse a request's message list; the error names the index of the bad message."""
    return tuple(Message.from_openai(m, index=i) for i, m in enumerate(message_list(raw)))


def _parse_content(value: Any) -> str | tuple[str, ...]:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list | tuple):
        raise MessageError(f"content must be a string or a list of text parts, got {type(value).__name__}")
    if not value:
        return ""
    parts = []
    for i, part in enumerate(value):
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise MessageError(
                f"content[{i}] is a {kind!r} part; sessions carry text only (parts of type 'text' with a "
                "string 'text')"
            )
        parts.append(part["text"])
    return tuple(parts)


def _optional_str(value: Any, what: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise MessageError(f"{what} must be a string, got {type(value).__name__}")
    return value


def replay_key(raw: Any, message: Message) -> dict[str, Any] | None:
    """A frozen copy of ``raw``, the form a request sent ``message`` in, to recognise that form when
    it is sent again; None when equality with it would not be exact.

    Invariant: anything equal (``==``) to the key parses to a message equal to ``message``, so a
    cache may reuse ``message`` (and verdicts about it) without parsing again. Equality is exact
    for plain JSON (see ``frozen_json_object``) but for numbers, since Python has
    ``1 == 1.0 == True``; a message reads numbers only in tool-call arguments sent as an object,
    so such a message gets no key (numbers in keys the parser ignores are harmless). The copy
    protects the key from a caller that edits its message dicts in place after sending them.
    """
    if not all(isinstance(call.arguments, str) for call in message.tool_calls):
        return None
    return frozen_json_object(raw)


def frozen_json_object(raw: Any) -> dict[str, Any] | None:
    """A deep copy of ``raw`` if it is a plain JSON object nesting at most ``MAX_KEY_DEPTH`` levels.

    Plain JSON: ``dict`` with ``str`` keys, ``list``, ``str``, ``int``, ``float``, ``bool`` and
    ``None``, exact types (what ``json.loads`` makes; no subclass, tuple or other mapping), so
    that ``==`` with the copy means JSON equality, but for ``1 == 1.0 == True``. None otherwise.
    """
    if type(raw) is not dict:
        return None
    try:
        return _copy(raw, MAX_KEY_DEPTH)
    except _NotPlainJson:
        return None


def equal_prefix(raw: list[Any], keys: list[Any]) -> int:
    """How many leading items of ``raw`` equal those of ``keys`` (``raw[i] == keys[i]``).

    The usual answer when a cache keys an agent's resent history, all of them, costs one list
    comparison at C speed; only a difference costs a scan to find it.
    """
    n = min(len(raw), len(keys))
    if raw[:n] == keys[:n]:
        return n
    return next((i for i in range(n) if raw[i] != keys[i]), n)


class _NotPlainJson(Exception):
    pass


def _copy(value: Any, depth: int) -> Any:
    kind = type(value)
    if value is None or kind is str or kind is int or kind is float or kind is bool:
        return value
    if depth == 0:
        raise _NotPlainJson
    if kind is list:
        return [_copy(item, depth - 1) for item in value]
    if kind is dict:
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _NotPlainJson
            out[key] = _copy(item, depth - 1)
        return out
    raise _NotPlainJson
