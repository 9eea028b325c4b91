"""Reading a model's reply: where its reasoning ends and which tools it called.

Each tool-call format is the one the family's chat template writes for a call in the history,
because that is the format the model was trained to emit. Every parser returns the text outside
the call blocks as content, the calls in OpenAI shape (``{id, type: "function", function: {name,
arguments: JSON string}}``), and a list of errors: a block that does not parse is left in the
content and reported, never silently dropped.

Formats whose argument values are written as bare text (GLM, MiniMax, Qwen3.5's XML) cannot say
whether ``3`` is a number or a string; the tool's JSON schema decides when it is given, else a
value that reads as JSON is taken as JSON.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolParse:
    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ToolCallParser(Protocol):
    """Finds the tool calls in a reply's text (reasoning already removed)."""

    name: str

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None) -> ToolParse: ...


@dataclass(frozen=True)
class ReasoningParser:
    """Splits ``<think>…</think>`` style reasoning from the visible content.

    ``opened_by_prompt``: with thinking on, the generation prompt already wrote ``start``, so the
    output begins inside the reasoning. Output that begins with ``start`` itself is reasoning either
    way. Output without ``end`` is all reasoning (cut by the length limit) unless
    ``unclosed_is_reasoning`` is False: for templates that sometimes open no reasoning at all
    (DeepSeek V3.1 after a tool result), text without ``end`` is content.
    """

    start: str = "<think>"
    end: str = "</think>"
    opened_by_prompt: bool = False
    unclosed_is_reasoning: bool = True
    #: Output that begins with ``end`` alone has no reasoning (the model chose not to reason, as
    #: MiniMax-M3 does in its adaptive mode: its template writes such a reply as ``end`` + content).
    bare_end_is_no_reasoning: bool = False

    def split(self, text: str, *, thinking: bool) -> tuple[str | None, str]:
        body = text.lstrip()
        if self.bare_end_is_no_reasoning and body.startswith(self.end):
            return None, body[len(self.end) :].strip()
        if body.startswith(self.start):
            body = body[len(self.start) :]
        elif not (thinking and self.opened_by_prompt):
            return None, text.strip()
        reasoning, found, content = body.partition(self.end)
        if not found:
            return (reasoning.strip(), "") if self.unclosed_is_reasoning else (None, text.strip())
        return reasoning.strip(), content.strip()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _parameter_types(tools: Sequence[Mapping[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("name") == name:
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            if isinstance(properties, Mapping):
                return {
                    key: (spec or {}).get("type")
                    for key, spec in properties.items()
                    if isinstance(spec, Mapping)
                }
    return {}


#: A function name as the XML-ish formats write it: no spaces, quotes, braces or tags.
_NAME = re.compile(r"[^\s<>{}\"']+")

_LITERALS = {"true": True, "false": False, "null": None, "none": None}


def coerce_value(raw: str, kind: Any) -> Any:
    """A bare-text argument value as the tool's schema type says (or as JSON when it parses)."""
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return raw
    if kind in ("boolean", "null") and raw.strip().lower() in _LITERALS:
        return _LITERALS[raw.strip().lower()]
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw


class _BlockParser(abc.ABC):
    """Shared loop: find ``start … end`` blocks, parse each, keep the rest as content.

    Each family's tool-call format subclasses it and says how one block's body becomes a call.
    """

    name = "block"
    start = ""
    end = ""
    #: Whether text between two blocks is content (False: formats that wrap all calls in one section).
    outer: tuple[str, str] | None = None

    @abc.abstractmethod
    def parse_block(self, body: str, tools: Sequence[Mapping[str, Any]] | None, index: int) -> dict[str, Any]:
        """One block's body as an OpenAI tool call; raise ``ValueError`` when it does not parse."""

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None) -> ToolParse:
        region_start, region_end = 0, len(text)
        before, after = text, ""
        if self.outer is not None:
            open_at = text.find(self.outer[0])
            if open_at < 0:
                return ToolParse(content=text.strip())
            close_at = text.find(self.outer[1], open_at)
            region_start = open_at + len(self.outer[0])
            region_end = close_at if close_at >= 0 else len(text)
            before = text[:open_at]
            after = text[close_at + len(self.outer[1]) :] if close_at >= 0 else ""
        result = ToolParse(content="")
        kept: list[str] = [before] if self.outer is not None else []
        pos = region_start
        region = text
        while True:
            open_at = region.find(self.start, pos, region_end)
            if open_at < 0:
                if self.outer is None:
                    kept.append(region[pos:region_end])
                elif region[pos:region_end].strip():
                    stray = region[pos:region_end].strip()
                    result.errors.append(f"unexpected text in the tool-call section: {stray[:80]!r}")
                    kept.append(stray)
                break
            if self.outer is None:
                kept.append(region[pos:open_at])
            close_at = region.find(self.end, open_at + len(self.start), region_end)
            if close_at < 0:
                result.errors.append(
                    f"tool call {len(result.calls) + len(result.errors) + 1}: no closing {self.end!r}"
                )
                kept.append(region[open_at:region_end])
                break
            body = region[open_at + len(self.start) : close_at]
            try:
                result.calls.append(self.parse_block(body, tools, len(result.calls)))
            except ValueError as err:
                result.errors.append(f"tool call {len(result.calls) + len(result.errors) + 1}: {err}")
                kept.append(region[open_at : close_at + len(self.end)])
            pos = close_at + len(self.end)
        if self.outer is not None:
            kept.append(after)
        result.content = "".join(kept).strip()
        return result


class JsonTagToolParser(_BlockParser):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Qwen2.5, Qwen3, Hermes)."""

    name = "json-tag"

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.start, self.end = start, end

    def parse_block(self, body: str, tools: Sequence[Mapping[str, Any]] | None, index: int) -> dict[str, Any]:
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON ({err.msg} at char {err.pos})") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            raise ValueError('expected {"name": ..., "arguments": {...}}')
        arguments = payload.get("arguments", payload.get("parameters", {}))
        if isinstance(arguments, str):  # some models double-encode; accept a JSON string of an object
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ValueError("arguments is a string that is not JSON") from None
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
        return openai_call(payload["name"], arguments)


class XmlFunctionToolParser(_BlockParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…</function></tool_call>`` (Qwen3.5, Nemotron 3)."""

    name = "xml-function"
    start, end = "<tool_call>", "</tool_call>"
    _function = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.S)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def parse_block(self, body: str, tools: Sequence[Mapping[str, Any]] | None, index: int) -> dict[str, Any]:
        match = self._function.match(body)
        if not match:
            raise ValueError("expected <function=NAME>…</function>")
        name, inner = match.group(1).strip(), match.group(2)
        types = _parameter_types(tools, name)
        arguments = {
            key.strip(): coerce_value(value, types.get(key.strip()))
            for key, value in self._parameter.findall(inner)
        }
        leftover = self._parameter.sub("", inner).strip()
        if leftover:
            raise ValueError(f"unexpected text in <function={name}>: {leftover[:60]!r}")
        return openai_call(name, arguments)


class GlmToolParser(_BlockParser):
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`` (GLM-4.5 onwards)."""

    name = "glm"
    start, end = "<tool_call>", "</tool_call>"
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse_block(self, body: str, tools: Sequence[Mapping[str, Any]] | None, index: int) -> dict[str, Any]:
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        if not _NAME.fullmatch(name):
            raise ValueError("expected the function name before the first <arg_key>")
        rest = "" if first < 0 else body[first:]
        types = _parameter_types(tools, name)
        arguments = {
            key.strip(): coerce_value(value, types.get(key.strip()))
            for key, value in self._pair.findall(rest)
        }
        if self._pair.sub("", rest).strip():
            raise ValueError("unpaired <arg_key>/<arg_value>")
        return openai_call(name, arguments)


class MiniMaxToolParser(_BlockParser):
    """``<minimax:tool_call><invoke name="N"><parameter name="K">V</parameter></invoke>…</minimax:tool_call>``."""

    name = "minimax"
    outer = ("<minimax:tool_call>", "</minimax:tool_call>")
    start, end = "<invoke name=", "</invoke>"
    _head = re.compile(r'^"([^"]+)">(.*)$', re.S)
    _parameter = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)

    def parse_block(self, body: str, tools: Sequence[Mapping[str, Any]] | None, index: int) -> dict[str, Any]:
        match = self._head.match(body)
        if not match:
            raise ValueError('expected <invoke name="NAME">')
        name, inner = match.group(1), match.group(2)
        types = _parameter_types(tools, name)
        arguments = {
            key: coerce_value(value, types.get(key)) for key, value in self._parameter.findall(inner)
        }
        if self._parameter.sub("", inner).strip():
            raise ValueError(f"unexpected text in <invoke name={name!r}>")
        return openai_call(name, arguments)


#: The namespace marker MiniMax-M3's template writes before every tag of a tool call.
MINIMAX_M3_NS = "]<]minimax[>["


class MiniMaxM3ToolParser(_BlockParser):
    """MiniMax-M3: ``NS<tool_call>\nNS<invoke name="N">NS<k>V NS</k>…NS</invoke>\n…NS</tool_call>``.

    ``NS`` is :data:`MINIMAX_M3_NS`. A value that is an object is written as nested ``NS<key>``
    elements, a list as ``NS<item>`` elements, anything else as bare text (typed by the tool's
    schema at the top level, else read as JSON when it parses).
    """

    name = "minimax-m3"
    outer = (MINIMAX_M3_NS + "<tool_call>", MINIMAX_M3_NS + "</tool_call>")
    start, end = MINIMAX_M3_NS + "<invoke name=", MINIMAX_M3_NS + "</invoke>"
    _head = re.compile(r'^"([^"]+)">(.*)$', re.S)

    def parse_block(self, body: str, tools: Sequence[Mapping[str, Any]] | None, index: int) -> dict[str, Any]:
        match = self._head.match(body)
        if not match:
            raise ValueError('expected <invoke name="NAME">')
        name, inner = match.group(1), match.group(2)
        types = _parameter_types(tools, name)
        elements = self._elements(inner)
        if elements is None:
            raise ValueError(f"unexpected text in <invoke name={name!r}>")
        arguments = {key: self._value(raw, types.get(key)) for key, raw in elements}
        return openai_call(name, arguments)

    def _elements(self, text: str) -> list[tuple[str, str]] | None:
        """``NS<k>…NS</k>`` elements one after another (nesting respected), or None if ``text`` is not only those."""
        out: list[tuple[str, str]] = []
        pos, ns = 0, MINIMAX_M3_NS
        while pos < len(text):
            if not text.startswith(ns + "<", pos):
                return None
            close = text.find(">", pos + len(ns) + 1)
            if close < 0:
                return None
            key = text[pos + len(ns) + 1 : close]
            if not key or key.startswith("/"):
                return None
            opening, closing = f"{ns}<{key}>", f"{ns}</{key}>"
            depth, scan = 1, close + 1
            while depth:
                next_open = text.find(opening, scan)
                next_close = text.find(closing, scan)
                if next_close < 0:
                    return None
                if 0 <= next_open < next_close:
                    depth, scan = depth + 1, next_open + len(opening)
                else:
                    depth, scan = depth - 1, next_close + len(closing)
            out.append((key, text[close + 1 : scan - len(closing)]))
            pos = scan
        return out

    def _value(self, raw: str, kind: Any) -> Any:
        if raw.startswith(MINIMAX_M3_NS + "<"):
            elements = self._elements(raw)
            if elements is not None:
                if elements and all(key == "item" for key, _ in elements) and kind != "object":
                    return [self._value(item, None) for _, item in elements]
                return {key: self._value(value, None) for key, value in elements}
        return coerce_value(raw, kind)


class DeepSeekToolParser(_BlockParser):
    """DeepSeek's special-token format.

    V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``; R1/V3 (``fenced``):
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``;
    all inside ``<｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜>``.
    """

    outer = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    start, end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"

    def __init__(self, *, fenced: bool = False) -> None:
        self.fenced = fenced
        self.name = "deepseek-r1" if fenced else "deepseek-v3.1"

    def parse_block(self, body: str, tools: Sequence[Mapping[str, Any]] | None, index: int) -> dict[str, Any]:
        head, found, tail = body.partition(self.sep)
        if not found:
            raise ValueError(f"no {self.sep!r}")
        if self.fenced:
            match = re.match(r"^(.*?)\n```json\n(.*)\n```$", tail, re.S)
            if not match:
                raise ValueError("expected NAME then a ```json fenced block")
            name, raw = match.group(1).strip(), match.group(2)
        else:
            name, raw = head.strip(), tail
        try:
            arguments = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON arguments ({err.msg} at char {err.pos})") from None
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
        return openai_call(name, arguments)


class KimiToolParser(_BlockParser):
    """Kimi K2: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>``.

    The id the model writes (``functions.NAME:IDX``) is the call's id; the name is read from it.
    """

    name = "kimi-k2"
    outer = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    start, end = "<|tool_call_begin|>", "<|tool_call_end|>"
    sep = "<|tool_call_argument_begin|>"
    _id = re.compile(r"^(?:functions\.)?(.+):(\d+)$")

    def parse_block(self, body: str, tools: Sequence[Mapping[str, Any]] | None, index: int) -> dict[str, Any]:
        call_id, found, raw = body.partition(self.sep)
        if not found:
            raise ValueError(f"no {self.sep!r}")
        call_id = call_id.strip()
        match = self._id.match(call_id)
        if not match:
            raise ValueError(f"call id {call_id!r} is not functions.NAME:INDEX")
        try:
            arguments = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON arguments ({err.msg} at char {err.pos})") from None
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
        return openai_call(match.group(1), arguments, call_id)
