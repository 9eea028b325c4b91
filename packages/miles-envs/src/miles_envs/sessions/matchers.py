"""Replay matchers: does a message the agent replays count as the message already recorded there?

A matcher answers that one question, ``matcher(recorded, incoming) -> bool``. When it says
yes, the recorded message and its recorded tokens stay authoritative and only what comes
after is tokenized; when it says no, the session treats the request as diverging there
(a linear session rolls back one turn or refuses, a branching session opens a branch).

Built-ins, strictest first:

* ``strict`` (the default): every field a chat template reads must agree: role, content,
  reasoning content, tool calls (id, type, function name, arguments as sent), tool-call id
  and name. Keys no template reads are never compared (they are dropped when parsing).
* ``json_args``: like ``strict``, but tool-call arguments are compared as parsed JSON values,
  so a harness that re-serialises them (key order, spacing, ``1.0`` written as ``1``) or
  sends ``{}`` / nothing for absent arguments still matches. Call ids, function names and
  the order of the calls must still agree. Arguments that do not parse as JSON (or carry
  duplicate keys, NaN or Infinity) must then agree exactly.
* ``loose``: role and visible text only. **Risky**: two assistant turns with the same
  (often empty) text but different tool calls count as the same message, so the recorded
  call is kept and the trainer sees a call the agent never made, silently. Use it only for
  harnesses that rewrite messages in ways you have checked are harmless.

A user matcher is any callable with the same signature, named by an entry point in the
``miles.session_matchers`` group or by an import path ``package.module:attr`` (a class is
instantiated with the given options). ``resolve_matcher`` wraps every matcher so that an
exception or a non-bool answer becomes one clear ``MatcherError``.

Every matcher must be a function of its two messages: the same pair, the same answer. A
session asks once per resent form: a message the agent resends as the very JSON value the
matcher already accepted at that place is not put to it again (see ``miles_envs.sessions.store``).
Accepting a message as equal to itself is not required.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from miles_envs.sessions.errors import MatcherError
from miles_envs.sessions.messages import Arguments, Message, ToolCall

Matcher = Callable[[Message, Message], bool]

BUILTIN_MATCHERS = ("strict", "json_args", "loose")


def strict(recorded: Message, incoming: Message) -> bool:
    """Every template-read field agrees; tool-call arguments agree as sent."""
    return _same_fields(recorded, incoming) and _same_calls(recorded, incoming, _exact_arguments)


def json_args(recorded: Message, incoming: Message) -> bool:
    """Like ``strict``, with tool-call arguments compared as parsed JSON values."""
    return _same_fields(recorded, incoming) and _same_calls(recorded, incoming, _json_arguments)


def loose(recorded: Message, incoming: Message) -> bool:
    """Role and visible text only (risky: tool calls and reasoning are ignored)."""
    return recorded.role == incoming.role and recorded.text == incoming.text


def differences(recorded: Message, incoming: Message) -> list[str]:
    """The fields in which two messages differ exactly, e.g. ``["tool_calls[0].arguments"]``.

    Used to explain a rejection: whichever matcher refused the pair, this says where to look.
    """
    diffs = [
        name
        for name in ("role", "content", "reasoning_content", "tool_call_id", "name")
        if getattr(recorded, name) != getattr(incoming, name)
    ]
    if len(recorded.tool_calls) != len(incoming.tool_calls):
        diffs.append(
            f"tool_calls (recorded {len(recorded.tool_calls)} calls, got {len(incoming.tool_calls)})"
        )
        return diffs
    for i, (a, b) in enumerate(zip(recorded.tool_calls, incoming.tool_calls, strict=True)):
        diffs += [
            f"tool_calls[{i}].{name}"
            for name in ("id", "type", "name")
            if getattr(a, name) != getattr(b, name)
        ]
        if not _exact_arguments(a.arguments, b.arguments):
            diffs.append(f"tool_calls[{i}].arguments")
    return diffs


class CheckedMatcher:
    """A matcher wrapped so that misbehaviour is one clear error instead of a silent wrong answer."""

    def __init__(self, matcher: Matcher, label: str) -> None:
        self.matcher = matcher
        self.label = label

    def __call__(self, recorded: Message, incoming: Message) -> bool:
        try:
            result = self.matcher(recorded, incoming)
        except Exception as err:
            raise MatcherError(f"session matcher {self.label} raised {type(err).__name__}: {err}") from err
        if not isinstance(result, bool):
            raise MatcherError(
                f"session matcher {self.label} must return a bool, returned {type(result).__name__} ({result!r})"
            )
        return result

    def __repr__(self) -> str:
        return f"CheckedMatcher({self.label})"


def checked(matcher: Matcher, label: str | None = None) -> CheckedMatcher:
    """Wrap ``matcher`` (idempotent)."""
    if isinstance(matcher, CheckedMatcher):
        return matcher
    if not callable(matcher):
        raise MatcherError(
            f"a session matcher must be callable (recorded, incoming) -> bool, got {matcher!r}"
        )
    name = label or getattr(matcher, "__qualname__", None) or type(matcher).__name__
    return CheckedMatcher(matcher, repr(name) if label is None else label)


def resolve_matcher(ref: str | Matcher, options: dict[str, Any] | None = None) -> CheckedMatcher:
    """The matcher ``ref`` names: a callable, a name in ``miles.session_matchers`` (``strict``,
    ``json_args``, ``loose`` or a plugin's), or an import path ``package.module:attr``.

    Unknown names fail here, before any session exists, with the plugin system's "did you mean".
    """
    if not isinstance(ref, str):
        if options:
            raise MatcherError("options can only be given with a matcher named by a string")
        return checked(ref)
    from miles.plugins import make_component  # the plugin index is only needed when naming one

    return checked(make_component("session_matcher", ref, options), repr(ref))


# ---------------------------------------------------------------------------- fields


def _same_fields(a: Message, b: Message) -> bool:
    return (
        a.role == b.role
        and a.content == b.content
        and a.reasoning_content == b.reasoning_content
        and a.tool_call_id == b.tool_call_id
        and a.name == b.name
    )


def _same_calls(a: Message, b: Message, same_arguments: Callable[[Arguments, Arguments], bool]) -> bool:
    if len(a.tool_calls) != len(b.tool_calls):
        return False
    return all(_same_call(x, y, same_arguments) for x, y in zip(a.tool_calls, b.tool_calls, strict=True))


def _same_call(a: ToolCall, b: ToolCall, same_arguments: Callable[[Arguments, Arguments], bool]) -> bool:
    return a.id == b.id and a.type == b.type and a.name == b.name and same_arguments(a.arguments, b.arguments)


# ------------------------------------------------------------------------- arguments

_NOT_JSON = object()
_EMPTY: tuple[str, Any] = ("object", {})


def _exact_arguments(a: Arguments, b: Arguments) -> bool:
    """As sent: strings byte for byte; objects (when a harness sent one) by type-exact value."""
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    ca, cb = _canonical(a, exact_numbers=True), _canonical(b, exact_numbers=True)
    if ca is _NOT_JSON or cb is _NOT_JSON:
        return type(a) is type(b) and a == b
    return ca == cb


def _json_arguments(a: Arguments, b: Arguments) -> bool:
    """As JSON values; absent arguments (``""``, ``"{}"``, ``{}``) are all the empty object."""
    va, vb = _json_value(a), _json_value(b)
    if va is _NOT_JSON or vb is _NOT_JSON:
        return _exact_arguments(a, b)
    return va == vb


def _json_value(arguments: Arguments) -> Any:
    if isinstance(arguments, str):
        if not arguments.strip():
            return _EMPTY
        try:
            value = json.loads(
                arguments,
                parse_float=Decimal,
                parse_int=Decimal,
                parse_constant=_reject_constant,
                object_pairs_hook=_no_duplicate_keys,
            )
        except ValueError:
            return _NOT_JSON
    else:
        value = arguments
    return _canonical(value, exact_numbers=False)


def _canonical(value: Any, *, exact_numbers: bool) -> Any:
    """A comparable form of a JSON value, tagged by type so that ``True`` never equals ``1``.

    With ``exact_numbers`` an int and a float are different kinds (``1`` vs ``1.0``); without,
    numbers compare by exact decimal value.
    """
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float | Decimal):
        if isinstance(value, float) and not math.isfinite(value):
            return _NOT_JSON
        if exact_numbers:
            return (type(value).__name__, value)
        return ("number", value if isinstance(value, Decimal) else Decimal(repr(value)))
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list | tuple):
        items = tuple(_canonical(v, exact_numbers=exact_numbers) for v in value)
        return _NOT_JSON if any(i is _NOT_JSON for i in items) else ("array", items)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return _NOT_JSON
        members = {k: _canonical(v, exact_numbers=exact_numbers) for k, v in value.items()}
        return _NOT_JSON if any(v is _NOT_JSON for v in members.values()) else ("object", members)
    return _NOT_JSON


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out
