"""A model family: one chat template, one reasoning parser, one tool-call parser, one boundary rule.

The session server renders the first turn of a conversation with the family's template and
afterwards only appends: it keeps the engine's own output ids (ending in the model's stop token)
and adds the ids of the new messages behind them. :meth:`ModelFamily.suffix_ids` computes those
ids without looking at the history: it renders the new messages behind a small fixed *anchor*
conversation and cuts right after the anchor's reply, where the family knows the model stops.
Its cost therefore depends on the new messages only, never on the length of the conversation.

This only gives the same ids as rendering the whole conversation when the template is
append-only at those cuts; ``miles check-family`` (``miles_envs.families.check``) verifies that for
each registered family. Where an official template rewrites history (Qwen3 and MiniMax drop the
reasoning of earlier turns), the family applies small, named :class:`TemplateEdit` s that keep
what the model generated, because a token-in-token-out server cannot take tokens back.

Nothing here imports transformers: a tokenizer is any object with the Hugging Face methods used
(``apply_chat_template``, ``encode``, ``decode``, ``convert_tokens_to_ids``, ``chat_template``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from miles.errors import MilesError

if TYPE_CHECKING:
    from miles_envs.families.artefacts import Artefacts, PinnedFile
    from miles_envs.families.parsers import ReasoningParser, ToolCallParser

logger = logging.getLogger(__name__)

Message = dict[str, Any]
#: A thinking switch: None (the template's default), on/off, or a named mode (MiniMax-M3's "adaptive").
Thinking = bool | str | None
Tokenizer = Any  # a Hugging Face tokenizer (PreTrainedTokenizerBase); typed loosely to stay import-light

#: Text of the fixed anchor reply; suffix_ids finds the cut by looking for it.
ANCHOR_REPLY = "MILES_ANCHOR_REPLY"
ANCHOR_USER = "MILES_ANCHOR_QUERY"


class FamilyError(MilesError):
    """A family cannot render or parse what it was given (bad messages, a foreign template, ...)."""


class TemplateKwargsError(FamilyError):
    """``chat_template_kwargs`` the family's template does not take, or a value it cannot take."""


class FamilyArtefactError(FamilyError):
    """A pinned artefact file is missing or its sha256 differs from the pinned one."""


@dataclass(frozen=True)
class TemplateEdit:
    """One literal replacement applied to a template; ``old`` must occur exactly once."""

    old: str
    new: str
    why: str


@dataclass
class ParsedReply:
    """What the engine's output ids mean as an OpenAI assistant message.

    ``status`` is ``"ok"`` or ``"malformed_tool_call"`` (a tool-call block that does not parse:
    its text is left in ``content`` and ``errors`` says why). ``stopped`` says whether the
    output ended with one of the family's stop tokens (False: cut by the length limit).
    """

    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    status: str = "ok"
    errors: list[str] = field(default_factory=list)
    stopped: bool = True

    def to_message(self) -> Message:
        """The assistant message (OpenAI shape) that the server stores and returns."""
        message: Message = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = copy.deepcopy(self.tool_calls)
        return message


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, kw_only=True, eq=False)  # a registration is compared (and hashed) by identity
class ModelFamily:
    """A registered family (see the module docstring).

    Fields:
        name: the name users give at launch (``--family`` / ``session.family``).
        chat_template: pinned template text, or None for the tokenizer's own template.
        template_edits: applied to that template (each must match exactly once).
        template_kwargs: fixed extra variables passed to the template.
        thinking: ``"switch"`` (the template has an on/off variable, ``thinking_kwarg``),
            ``"always"`` (the model always reasons) or ``"never"`` (no reasoning).
        default_thinking: what the template does when no switch is passed (a mode name with
            ``thinking_modes``).
        thinking_modes: for a switch that takes named modes instead of a bool (MiniMax-M3's
            ``thinking_mode``): each mode and whether the model reasons in it (None: the model
            decides per turn). ``True`` / ``False`` select the modes marked so.
        reasoning_parser / tool_parser: read the engine's output (None: none of that kind).
        tool_arguments: the type the template expects for ``tool_calls[].function.arguments``
            (``"dict"`` or ``"json"``, a JSON string); messages are converted before rendering.
        turn_end: the text the template writes at the end of an assistant turn, which is
            the model's stop token (``<|im_end|>``). None when the model stops by emitting the
            next message's role token instead (``next_role_stops``, GLM).
        extra_stop_tokens: further stop tokens (``<|endoftext|>``).
        append_roles: roles a later turn may append (others are rejected by suffix_ids).
        verified_templates: sha256 of each template text (after edits) that the check passed on;
            rendering with another template logs a warning once.
        artefacts: the offline tokenizer/template the check runs on (None: needs ``--tokenizer``).
        template_variants: other official revisions of the template (pinned files) that the check
            also runs, on the same vocabulary.
        tool_call_id_style: ``"openai"`` or ``"kimi"`` (``functions.NAME:INDEX``): the ids the model
            itself writes, used by the check's conversations.
        tools_in_thinking: False when the model calls tools only with thinking off (DeepSeek V3.1);
            the check then skips tool conversations in thinking mode.
        notes: what a user of the family should know (shown by ``miles check-family``).
    """

    name: str
    description: str = ""
    chat_template: str | None = None
    template_edits: tuple[TemplateEdit, ...] = ()
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    thinking: Literal["switch", "always", "never"] = "never"
    thinking_kwarg: str = "enable_thinking"
    default_thinking: bool | str = False
    thinking_modes: Mapping[str, bool | None] = field(default_factory=dict)
    reasoning_parser: ReasoningParser | None = None
    tool_parser: ToolCallParser | None = None
    tool_arguments: Literal["dict", "json"] = "dict"
    turn_end: str | None = None
    next_role_stops: Mapping[str, str] = field(default_factory=dict)
    extra_stop_tokens: tuple[str, ...] = ()
    append_roles: frozenset[str] = frozenset({"user", "tool", "system"})
    verified_templates: frozenset[str] = frozenset()
    artefacts: Artefacts | None = None
    template_variants: tuple[PinnedFile, ...] = ()
    tool_call_id_style: Literal["openai", "kimi"] = "openai"
    tools_in_thinking: bool = True
    notes: str = ""

    def __post_init__(self) -> None:
        if (self.turn_end is None) == (not self.next_role_stops):
            raise ValueError(f"family {self.name!r}: give exactly one of turn_end and next_role_stops")
        if self.thinking != "never" and self.reasoning_parser is None:
            raise ValueError(f"family {self.name!r} reasons but has no reasoning parser")
        if self.thinking_modes:
            marks = list(self.thinking_modes.values())
            if self.thinking != "switch" or marks.count(True) != 1 or marks.count(False) != 1:
                raise ValueError(
                    f"family {self.name!r}: thinking_modes needs a switch with exactly one mode marked True "
                    "and one marked False"
                )
        if isinstance(self.default_thinking, str) and self.default_thinking not in self.thinking_modes:
            raise ValueError(f"family {self.name!r}: default_thinking names no mode of thinking_modes")

    # ------------------------------------------------------------------ templates

    def template(self, tokenizer: Tokenizer) -> str:
        """The template text this family renders with (pinned or the tokenizer's, after edits)."""
        base = (
            self.chat_template
            if self.chat_template is not None
            else getattr(tokenizer, "chat_template", None)
        )
        if isinstance(base, dict):  # some tokenizers keep named templates; the default one is ours
            base = base.get("default")
        if not isinstance(base, str) or not base:
            raise FamilyError(
                f"family {self.name!r}: the tokenizer has no chat template and the family pins none"
            )
        text = _apply_edits(self.name, base, self.template_edits)
        self._warn_if_unverified(text)
        return text

    def _warn_if_unverified(self, text: str) -> None:
        if not self.verified_templates:
            return
        digest = sha256_text(text)
        key = (self.name, digest)
        if digest not in self.verified_templates and key not in _WARNED:
            _WARNED.add(key)
            logger.warning(
                "family %r: this chat template (sha256 %s) is not one the append-only check passed on; "
                "run `miles check-family %s --tokenizer DIR` on this tokenizer",
                self.name,
                digest[:12],
                self.name,
            )

    def template_variables(self, enable_thinking: Thinking) -> dict[str, Any]:
        """The extra template variables for one render (fixed kwargs + the thinking switch)."""
        kwargs = dict(self.template_kwargs)
        if enable_thinking is None:
            return kwargs
        if self.thinking == "switch":
            kwargs[self.thinking_kwarg] = self._switch_value(enable_thinking)
        elif isinstance(enable_thinking, str):
            raise FamilyError(f"family {self.name!r} has no named thinking modes; got {enable_thinking!r}")
        elif self.thinking == "always" and not enable_thinking:
            raise FamilyError(f"family {self.name!r} always reasons; enable_thinking=False is not supported")
        elif self.thinking == "never" and enable_thinking:
            raise FamilyError(
                f"family {self.name!r} has no reasoning mode; enable_thinking=True is not supported"
            )
        return kwargs

    def _switch_value(self, enable_thinking: bool | str) -> bool | str:
        """The value the template's switch variable gets (a mode name for named-mode switches)."""
        if not self.thinking_modes:
            if isinstance(enable_thinking, str):
                raise FamilyError(
                    f"family {self.name!r}: {self.thinking_kwarg} is on/off, not a named mode ({enable_thinking!r})"
                )
            return bool(enable_thinking)
        if isinstance(enable_thinking, str):
            if enable_thinking not in self.thinking_modes:
                raise FamilyError(
                    f"family {self.name!r}: {self.thinking_kwarg} must be one of "
                    f"{', '.join(self.thinking_modes)}; got {enable_thinking!r}"
                )
            return enable_thinking
        return next(name for name, on in self.thinking_modes.items() if on is bool(enable_thinking))

    def thinking_state(self, enable_thinking: Thinking) -> bool | None:
        """Whether the model reasons under this switch: True, False, or None (it decides per turn)."""
        if self.thinking == "always":
            return True
        if self.thinking == "never":
            return False
        value = self.default_thinking if enable_thinking is None else enable_thinking
        if isinstance(value, str):
            return self.thinking_modes[str(self._switch_value(value))]
        return bool(value)

    def thinking_on(self, enable_thinking: Thinking) -> bool:
        """Whether the generation prompt leaves the model inside its reasoning (a decided "on")."""
        return self.thinking_state(enable_thinking) is True

    def request_thinking(self, kwargs: Mapping[str, Any] | None) -> Thinking:
        """The thinking switch a request's ``chat_template_kwargs`` sets (None: not set).

        The one key accepted is the family's own switch (``thinking_kwarg``), with a value it
        takes: a bool, or for named-mode switches a mode name (or a bool). Anything else is a
        :class:`TemplateKwargsError`: a key the template does not read, a variable the family
        fixes to keep history append-only, or a switch on a family that has none.
        """
        if not kwargs:
            return None
        takes = self.thinking_kwarg if self.thinking == "switch" else None
        unknown = sorted(str(key) for key in kwargs if key != takes)
        if unknown:
            fixed = [key for key in unknown if key in self.template_kwargs]
            if takes is not None:
                allowed = f"it takes only {takes!r}"
            elif self.thinking == "always":
                allowed = "it takes none: the model always reasons"
            else:
                allowed = "it takes none: the model has no reasoning mode"
            why = (
                f"; {', '.join(repr(k) for k in fixed)} is fixed by the family to keep history append-only"
                if fixed
                else ""
            )
            raise TemplateKwargsError(
                f"family {self.name!r}: chat_template_kwargs {', '.join(repr(k) for k in unknown)} not taken by "
                f"its template ({allowed}){why}"
            )
        assert takes is not None
        value = kwargs[takes]
        if value is None:
            return None
        if isinstance(value, bool) or (isinstance(value, str) and value in self.thinking_modes):
            return value
        expected = (
            f"true, false or one of {', '.join(repr(m) for m in self.thinking_modes)}"
            if self.thinking_modes
            else "true or false"
        )
        raise TemplateKwargsError(
            f"family {self.name!r}: chat_template_kwargs {takes!r} must be {expected}; got {value!r}"
        )

    # ------------------------------------------------------------------ rendering

    def prepare_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[Message]:
        """Copies of ``messages`` in the shape this family's template reads.

        ``content: None`` becomes ``""`` (transformers drops None-valued keys and several templates
        then fail), ``reasoning`` is also given as ``reasoning_content`` (the name templates read),
        ``reasoning_content: None`` is dropped, and tool-call arguments become a dict or a JSON
        string as the template expects.
        """
        out: list[Message] = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise FamilyError(f"message {index}: expected a mapping with a string 'role'")
            item = copy.deepcopy(dict(message))
            if item.get("content") is None:
                item["content"] = ""
            if item.get("reasoning_content") is None and isinstance(item.get("reasoning"), str):
                item["reasoning_content"] = item["reasoning"]  # the other name clients use for it
            if item.get("reasoning_content") is None:
                item.pop("reasoning_content", None)
            if item.get("tool_calls"):
                item["tool_calls"] = [self._prepare_call(index, call) for call in item["tool_calls"]]
            elif "tool_calls" in item:
                item.pop("tool_calls")
            out.append(item)
        return out

    def _prepare_call(self, index: int, call: Any) -> dict[str, Any]:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise FamilyError(f"message {index}: a tool call needs a 'function' object (OpenAI shape)")
        function = dict(call["function"])
        if not isinstance(function.get("name"), str):
            raise FamilyError(f"message {index}: a tool call needs function.name")
        arguments = function.get("arguments")
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as err:
                raise FamilyError(
                    f"message {index}: tool call {function['name']!r} arguments are not JSON: {err}"
                ) from err
        if not isinstance(arguments, dict):
            raise FamilyError(
                f"message {index}: tool call {function['name']!r} arguments must be a JSON object"
            )
        function["arguments"] = (
            arguments if self.tool_arguments == "dict" else json.dumps(arguments, ensure_ascii=False)
        )
        prepared = {key: value for key, value in call.items() if key != "function"}
        prepared.setdefault("type", "function")
        prepared["function"] = function
        return prepared

    def render_text(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: Thinking = None,
    ) -> str:
        """The template's text for ``messages`` (after :meth:`prepare_messages`)."""
        variables = self.template_variables(enable_thinking)
        prepared = self.prepare_messages(messages)
        try:
            text = tokenizer.apply_chat_template(
                prepared,
                tools=list(tools) if tools else None,
                chat_template=self.template(tokenizer),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except FamilyError:
            raise
        except Exception as err:  # jinja errors, raise_exception(...) in the template
            raise FamilyError(f"family {self.name!r}: the chat template failed: {err}") from err
        if not isinstance(text, str):
            raise FamilyError(
                f"family {self.name!r}: apply_chat_template returned {type(text).__name__}, not text"
            )
        return text

    def render_ids(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: Thinking = None,
    ) -> list[int]:
        """The ids of the whole rendered conversation (what the server sends on a first turn)."""
        text = self.render_text(
            tokenizer,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )
        return encode(tokenizer, text)

    # ------------------------------------------------------------------ incremental rendering

    def anchor(
        self, new_messages: Sequence[Mapping[str, Any]], previous: Mapping[str, Any] | None
    ) -> list[Message]:
        """The fixed conversation that stands in for the history in :meth:`suffix_ids`.

        It ends with an assistant reply whose content is :data:`ANCHOR_REPLY`. Its tool calls
        are those of ``previous`` (the stored last assistant message) when given, else one per
        leading tool result in ``new_messages``, because some templates check that a tool result
        answers a call.
        """
        calls: list[dict[str, Any]] = []
        if previous is not None and previous.get("tool_calls"):
            calls = copy.deepcopy(list(previous["tool_calls"]))
        else:
            for message in new_messages:
                if message.get("role") != "tool":
                    break
                calls.append(
                    {
                        "id": message.get("tool_call_id") or f"call_{len(calls)}",
                        "type": "function",
                        "function": {"name": message.get("name") or "tool", "arguments": "{}"},
                    }
                )
        reply: Message = {"role": "assistant", "content": ANCHOR_REPLY}
        if calls:
            reply["tool_calls"] = calls
        return [{"role": "user", "content": ANCHOR_USER}, reply]

    def turn_end_for(self, tokenizer: Tokenizer) -> str | None:
        """The turn-end text for this tokenizer (the generic family reads it from the tokenizer)."""
        return self.turn_end

    def reply_end(self, text: str, start: int, tokenizer: Tokenizer) -> tuple[int, str | None]:
        """Where the assistant turn that contains ``text[start]`` ends, and the stop token already consumed.

        With ``turn_end`` the turn ends right after the first ``turn_end`` at or after ``start``
        (the model generated it; nothing is consumed from what follows). With ``next_role_stops``
        it ends where the next message's role token begins; the model emitted that token as its
        stop, so the suffix must not repeat it (the returned token).
        """
        turn_end = self.turn_end_for(tokenizer)
        if turn_end is not None:
            end = text.find(turn_end, start)
            if end < 0:
                raise FamilyError(
                    f"family {self.name!r}: no {turn_end!r} after the reply in the rendered text"
                )
            return end + len(turn_end), None
        positions = [(text.find(token, start), token) for token in self.next_role_stops.values()]
        found = [(pos, token) for pos, token in positions if pos >= 0]
        if not found:
            return len(text), None
        pos, token = min(found)
        return pos, token

    def suffix_ids(
        self,
        tokenizer: Tokenizer,
        new_messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: Thinking = None,
        previous: Mapping[str, Any] | None = None,
        stop_id: int | None = None,
    ) -> list[int]:
        """The ids to append after a checkpoint that ends with the model's own reply and stop token.

        ``previous`` is the stored last assistant message (its tool calls shape the anchor);
        ``stop_id`` is the checkpoint's last token: for families whose model stops with the next
        role token, it must be the token the template puts next (else a clear error).
        ``new_messages`` use the family's ``append_roles``; an assistant message may also appear
        anywhere but last (a reply the client edited or wrote: the template renders it as history).
        """
        if not new_messages:
            raise FamilyError("suffix_ids needs at least one new message")
        for index, message in enumerate(new_messages):
            role = message.get("role") if isinstance(message, Mapping) else None
            if role == "assistant" and index < len(new_messages) - 1:
                # A reply the client sent (it edited the model's reply, or wrote one): history like
                # any other message, rendered as the template renders it, never trained on.
                continue
            if role not in self.append_roles:
                allowed = ", ".join(sorted(self.append_roles))
                raise FamilyError(
                    f"new message {index}: role {role!r} cannot be appended in family {self.name!r} (allowed: {allowed})"
                )
        anchor = self.anchor(new_messages, previous)
        text = self.render_text(
            tokenizer,
            anchor + list(new_messages),
            tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )
        start = text.find(ANCHOR_REPLY)
        if start < 0:
            raise FamilyError(
                f"family {self.name!r}: the template dropped the anchor reply; cannot cut the suffix"
            )
        cut, consumed = self.reply_end(text, start + len(ANCHOR_REPLY), tokenizer)
        if consumed is not None:
            expected = tokenizer.convert_tokens_to_ids(consumed)
            if stop_id is not None and stop_id != expected:
                got = tokenizer.convert_ids_to_tokens(stop_id)
                raise FamilyError(
                    f"family {self.name!r}: the reply stopped with {got!r} but the next message begins with "
                    f"{consumed!r}; the conversation cannot continue append-only"
                )
            cut += len(consumed)
        return encode(tokenizer, text[cut:])

    # ------------------------------------------------------------------ the engine's output

    def reply_stop(self, reply: Mapping[str, Any]) -> str | None:
        """The stop token the model emits after ``reply`` when the template does not write one.

        For next-role families: the tool-result role token after tool calls, else the user one.
        """
        if self.next_role_stops is None or not self.next_role_stops:
            return None
        role = "tool" if reply.get("tool_calls") else "user"
        return self.next_role_stops.get(role)

    def stop_tokens(self, tokenizer: Tokenizer) -> tuple[str, ...]:
        """The stop tokens as text: the turn end (or the next-role tokens), then any extra ones."""
        turn_end = self.turn_end_for(tokenizer)
        tokens = [turn_end] if turn_end else list(self.next_role_stops.values())
        return tuple(dict.fromkeys([*tokens, *self.extra_stop_tokens]))

    def stop_token_ids(self, tokenizer: Tokenizer) -> list[int]:
        """Ids the engine must stop at (the turn end / next-role tokens, then any extra ones)."""
        ids: list[int] = []
        for token in self.stop_tokens(tokenizer):
            token_id = _single_token_id(tokenizer, token)
            if token_id is None:
                raise FamilyError(
                    f"family {self.name!r}: stop token {token!r} is not one token in this tokenizer"
                )
            ids.append(token_id)
        return ids

    def parse_reply(
        self,
        tokenizer: Tokenizer,
        output_ids: Sequence[int],
        *,
        enable_thinking: Thinking = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ParsedReply:
        """Read the engine's output ids: reasoning, visible content and tool calls (OpenAI shape)."""
        ids = list(output_ids)
        stops = set(self.stop_token_ids(tokenizer))
        stopped = bool(ids) and ids[-1] in stops
        if stopped:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        reasoning: str | None = None
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.split(text, thinking=self.thinking_on(enable_thinking))
        if self.tool_parser is None:
            return ParsedReply(content=text.strip(), reasoning_content=reasoning, stopped=stopped)
        parsed = self.tool_parser.parse(text, tools)
        return ParsedReply(
            content=parsed.content,
            reasoning_content=reasoning,
            tool_calls=parsed.calls,
            status="malformed_tool_call" if parsed.errors else "ok",
            errors=parsed.errors,
            stopped=stopped,
        )


_WARNED: set[tuple[str, str]] = set()
_EDITED: dict[tuple[str, tuple[TemplateEdit, ...]], str] = {}


def _apply_edits(family: str, base: str, edits: Sequence[TemplateEdit]) -> str:
    if not edits:
        return base
    key = (sha256_text(base), tuple(edits))
    if key in _EDITED:
        return _EDITED[key]
    text = base
    for edit in edits:
        count = text.count(edit.old)
        if count != 1:
            raise FamilyError(
                f"family {family!r}: this chat template is not the one the family was written for "
                f"(the edit '{edit.why}' expects its text once, found it {count} times)"
            )
        text = text.replace(edit.old, edit.new)
    _EDITED[key] = text
    return text


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of rendered text; the template already wrote any BOS, so add no special tokens."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def _single_token_id(tokenizer: Tokenizer, token: str) -> int | None:
    ids = encode(tokenizer, token)
    return ids[0] if len(ids) == 1 else None
