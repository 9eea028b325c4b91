"""The CPU append-only check: does the session server's way of building ids match the template?

For each conversation shape the check plays the server:

1. first turn: ``ids = render_ids(messages before the first reply, generation prompt)``;
2. the engine's reply: the ids of the assistant message *as the template renders it* (from the
   end of the generation prompt to the model's stop token), which must also parse back into
   that message with the family's reasoning and tool-call parsers;
3. later turns: ``ids += suffix_ids(the new messages)``, rendering only the new messages;

and at every turn compares ``ids`` token by token with ``render_ids(the whole conversation so
far)``. A mismatch is reported with the turn, the stage, the first differing token position and
the decoded text around it on both sides.

Families whose official template rewrites history carry template edits; for them the check also
confirms that the edited template renders every first turn exactly as the official one does,
and counts in how many shapes the official template alone would have stayed append-only.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_envs.families.base import FamilyError, Message, ModelFamily, Tokenizer, encode, sha256_text

# ---------------------------------------------------------------------------- conversation shapes

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "days": {"type": "integer", "description": "Forecast length"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "top_k": {"type": "integer"},
                    "filters": {"type": "object"},
                },
                "required": ["query"],
            },
        },
    },
]

SYSTEM = "You are a careful assistant. Answer briefly."


@dataclass
class Shape:
    """A conversation; ``retry`` replaces everything from its last assistant reply on (a retried turn).

    ``client_replies``: indices of assistant messages the client wrote (an edited reply); the
    server appends them with the messages around them instead of generating them.
    """

    name: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    retry: list[Message] | None = None
    client_replies: frozenset[int] = frozenset()
    roles: frozenset[str] = frozenset()  # roles it appends after a reply (filled in by build_shapes)


class _Builder:
    """Small helpers that write messages the way a model/harness would (ids in the family's style)."""

    def __init__(self, thinking: bool, id_style: str) -> None:
        self.thinking, self.id_style, self.calls = thinking, id_style, 0

    def call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        index = self.calls
        self.calls += 1
        call_id = f"functions.{name}:{index}" if self.id_style == "kimi" else f"call_{index:03d}"
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }

    def reply(self, content: str, reasoning: str, *calls: dict[str, Any]) -> Message:
        message: Message = {"role": "assistant", "content": content}
        if self.thinking:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = list(calls)
        return message

    @staticmethod
    def result(call: Mapping[str, Any], content: str) -> Message:
        return {
            "role": "tool",
            "tool_call_id": call["id"],
            "name": call["function"]["name"],
            "content": content,
        }


def build_shapes(thinking: bool, system: bool, id_style: str = "openai") -> list[Shape]:
    """The conversation shapes, with reasoning in every reply when ``thinking``."""
    b = _Builder(thinking, id_style)
    head: list[Message] = [{"role": "system", "content": SYSTEM}] if system else []
    user = lambda text: {"role": "user", "content": text}  # noqa: E731

    plain = [
        *head,
        user("What is 2 + 3?"),
        b.reply("2 + 3 = 5.", "Simple addition: 2 plus 3 is 5."),
        user("And times 4?"),
        b.reply("5 × 4 = 20.", "The previous answer was 5; multiplied by 4 gives 20."),
        user("Thanks! Say bye."),
        b.reply("Bye!", "The user is leaving; say goodbye."),
    ]

    b.calls = 0
    w = b.call("get_weather", {"city": "Paris"})
    single = [
        *head,
        user("Weather in Paris?"),
        b.reply("", "I should call the weather tool for Paris.", w),
        b.result(w, '{"temp_c": 18, "sky": "cloudy"}'),
        b.reply("It is 18 °C and cloudy in Paris.", "The tool says 18 C, cloudy."),
    ]

    b.calls = 0
    w1, w2 = b.call("get_weather", {"city": "Paris", "days": 2}), b.call("get_weather", {"city": "Tokyo"})
    parallel = [
        *head,
        user("Compare the weather in Paris (2 days) and Tokyo."),
        b.reply("", "Two independent lookups; call both at once.", w1, w2),
        b.result(w1, '{"temp_c": [18, 20]}'),
        b.result(w2, '{"temp_c": 25}'),
        b.reply("Tokyo is warmer: 25 °C against 18–20 °C in Paris.", "Tokyo 25, Paris 18-20."),
    ]

    b.calls = 0
    s1 = b.call("search", {"query": "tallest building", "top_k": 3})
    s2 = b.call("search", {"query": "Burj Khalifa height", "filters": {"lang": "en", "year": 2024}})
    s3 = b.call("get_weather", {"city": "Dubai", "days": 1})
    chain = [
        *head,
        user("What is the tallest building, and how tall is it?"),
        b.reply("", "Search first.", s1),
        b.result(s1, "1. Burj Khalifa (Dubai)\n2. Merdeka 118\n3. Shanghai Tower"),
        b.reply("The tallest is the Burj Khalifa; let me check its height.", "Now find the height.", s2),
        b.result(s2, '{"height_m": 828}'),
        b.reply("The Burj Khalifa is 828 m tall.", "828 m."),
        user("Is it hot there today?"),
        b.reply("", "Dubai weather, one day.", s3),
        b.result(s3, '{"temp_c": 41, "sky": "clear"}'),
        b.reply("Yes: 41 °C and clear in Dubai.", "41 C is hot."),
    ]

    b.calls = 0
    mid_system = [
        *head,
        user("Name a colour."),
        b.reply("Blue.", "Any colour will do."),
        {"role": "system", "content": "From now on answer in French."},
        user("Name another."),
        b.reply("Rouge.", "Answer in French now."),
    ]

    b.calls = 0
    r = b.call("get_weather", {"city": "Oslo"})
    retry_main = [
        *head,
        user("Hello!"),
        b.reply("Hi! How can I help?", "A greeting."),
        user("Weather in Oslo?"),
        b.reply("I cannot know that.", "I have no data."),
    ]
    retry_tail = [
        b.reply("", "Use the tool instead.", r),
        b.result(r, '{"temp_c": -3}'),
        b.reply("It is -3 °C in Oslo.", "Cold."),
    ]

    b.calls = 0
    edited = [
        *head,
        user("Name a prime number."),
        b.reply("7.", "Any prime will do."),
        user("A bigger one?"),
        b.reply("101, as the client rewrote this reply.", "Pick a three-digit prime."),
        user("Is it odd?"),
        b.reply("Yes, 101 is odd.", "Every prime above 2 is odd."),
    ]

    shapes = [
        Shape("plain", plain),
        Shape("single-tool", single, TOOLS),
        Shape("parallel-tools", parallel, TOOLS),
        Shape("tool-chain", chain, TOOLS),
        Shape("system-mid", mid_system),
        Shape("retry", retry_main, TOOLS, retry=retry_tail),
        # The client edits the model's second reply, then asks on: the edit is history (suffix).
        Shape("edited-reply", edited, client_replies=frozenset({len(head) + 3})),
    ]
    for shape in shapes:
        shape.roles = _appended_roles(shape.messages) | _appended_roles(shape.retry or [])
    return shapes


def _appended_roles(messages: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    seen_reply, roles = False, set()
    for message in messages:
        if message["role"] == "assistant":
            seen_reply = True
        elif seen_reply:
            roles.add(message["role"])
    return frozenset(roles)


# ---------------------------------------------------------------------------- results


@dataclass
class Mismatch:
    """Where the server's ids first differ from the template's (or why the turn could not be built)."""

    turn: int
    stage: str  # prompt | reply | parse | official-first-turn | error
    detail: str
    position: int | None = None
    expected: str = ""
    got: str = ""


@dataclass
class CaseResult:
    shape: str
    thinking: bool | str | None
    system: bool
    status: str  # pass | fail | skip
    turns: int = 0
    mismatch: Mismatch | None = None
    reason: str = ""
    official_append_only: bool | None = None

    @property
    def case(self) -> str:
        mode = (
            f"/{self.thinking}"
            if isinstance(self.thinking, str)
            else {None: "", True: "/think", False: "/no-think"}[self.thinking]
        )
        return f"{self.shape}{mode}/{'system' if self.system else 'no-system'}"


@dataclass
class FamilyReport:
    family: str
    tokenizer: str
    template_sha256: str
    template_verified: bool
    stand_in: str | None = None
    cases: list[CaseResult] = field(default_factory=list)
    tokenizer_problem: str | None = None
    notes: str = ""

    @property
    def ok(self) -> bool:
        if self.tokenizer_problem is not None:
            return False
        return all(case.status != "fail" for case in self.cases) and any(
            c.status == "pass" for c in self.cases
        )

    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "fail": 0, "skip": 0}
        for case in self.cases:
            out[case.status] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "ok": self.ok,
            "tokenizer": self.tokenizer,
            "stand_in": self.stand_in,
            "template_sha256": self.template_sha256,
            "template_verified": self.template_verified,
            "tokenizer_problem": self.tokenizer_problem,
            "notes": self.notes,
            "counts": self.counts(),
            "cases": [{"case": case.case, **dataclasses.asdict(case)} for case in self.cases],
        }


# ---------------------------------------------------------------------------- the simulation


class _Fail(Exception):
    def __init__(self, mismatch: Mismatch) -> None:
        super().__init__(mismatch.detail)
        self.mismatch = mismatch


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """The first index where two id lists differ (a length difference counts), or None."""
    for index, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return index
    return None if len(expected) == len(got) else min(len(expected), len(got))


def _context(tokenizer: Tokenizer, ids: Sequence[int], position: int, width: int = 8) -> str:
    before = tokenizer.decode(list(ids[max(0, position - width) : position]), skip_special_tokens=False)
    after = tokenizer.decode(list(ids[position : position + width]), skip_special_tokens=False)
    return f"{before!r} ⟂ {after!r}"


def _compare(
    tokenizer: Tokenizer, turn: int, stage: str, expected: list[int], got: list[int], detail: str
) -> None:
    position = first_difference(expected, got)
    if position is not None:
        raise _Fail(
            Mismatch(
                turn=turn,
                stage=stage,
                detail=detail,
                position=position,
                expected=_context(tokenizer, expected, position),
                got=_context(tokenizer, got, position),
            )
        )


class _Run:
    """One family + tokenizer + thinking mode; plays the server over a conversation."""

    def __init__(
        self, family: ModelFamily, tokenizer: Tokenizer, tools: list | None, thinking: bool | str | None
    ) -> None:
        self.family, self.tokenizer, self.tools, self.thinking = family, tokenizer, tools, thinking

    def render(self, messages: Sequence[Message], generation: bool) -> str:
        return self.family.render_text(
            self.tokenizer,
            messages,
            self.tools,
            add_generation_prompt=generation,
            enable_thinking=self.thinking,
        )

    def reply_ids(self, turn: int, history: list[Message], reply: Message) -> list[int]:
        """The reply as the template renders it, up to and including the model's stop token."""
        prompt = self.render(history, True)
        full = self.render([*history, reply], False)
        if not full.startswith(prompt):
            _compare(
                self.tokenizer,
                turn,
                "reply",
                encode(self.tokenizer, prompt),
                encode(self.tokenizer, full)[: len(encode(self.tokenizer, prompt))],
                "the rendered reply does not extend the generation prompt",
            )
            raise _Fail(
                Mismatch(turn, "reply", "the rendered reply does not extend the generation prompt (text)")
            )
        end, _ = self.family.reply_end(full, len(prompt), self.tokenizer)
        ids = encode(self.tokenizer, full[len(prompt) : end])
        stop = self.family.reply_stop(reply)
        if stop is not None:
            ids.append(self.tokenizer.convert_tokens_to_ids(stop))
        return ids

    def check_parse(self, turn: int, ids: list[int], reply: Message) -> None:
        parsed = self.family.parse_reply(self.tokenizer, ids, enable_thinking=self.thinking, tools=self.tools)
        problems = list(parsed.errors)
        if not parsed.stopped:
            problems.append("the reply does not end with a stop token")
        if parsed.content.strip() != (reply.get("content") or "").strip():
            problems.append(f"content {parsed.content!r} != {reply.get('content')!r}")
        want_reasoning = (
            (reply.get("reasoning_content") or "").strip()
            if self.family.thinking_state(self.thinking) is not False
            else ""
        )
        if (parsed.reasoning_content or "").strip() != want_reasoning:
            problems.append(f"reasoning {parsed.reasoning_content!r} != {want_reasoning!r}")
        want_calls = [_call_key(call) for call in reply.get("tool_calls") or []]
        got_calls = [_call_key(call) for call in parsed.tool_calls]
        if want_calls != got_calls:
            problems.append(f"tool calls {got_calls} != {want_calls}")
        if self.family.tool_call_id_style == "kimi":
            want_ids = [call["id"] for call in reply.get("tool_calls") or []]
            if want_ids != [call["id"] for call in parsed.tool_calls]:
                problems.append("tool-call ids differ")
        if problems:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            raise _Fail(Mismatch(turn, "parse", "; ".join(problems), got=repr(text)))

    def play(
        self,
        messages: list[Message],
        resume: tuple[list[int], int] | None = None,
        client_replies: frozenset[int] = frozenset(),
    ) -> list[tuple[list[int], int]]:
        """Run the server over ``messages``; returns (prompt ids, reply index) at each turn.

        The assistant messages at ``client_replies`` are not generated: they are appended in the
        suffix with the messages around them, as the server does with a reply the client edited.
        """
        replies = [
            i
            for i, message in enumerate(messages)
            if message["role"] == "assistant" and i not in client_replies
        ]
        if resume is not None:
            ids, start_at = list(resume[0]), resume[1]
            replies = [i for i in replies if i >= start_at]
        else:
            ids = encode(self.tokenizer, self.render(messages[: replies[0]], True))
        prompts: list[tuple[list[int], int]] = []
        for turn, index in enumerate(replies):
            expected = encode(self.tokenizer, self.render(messages[:index], True))
            _compare(
                self.tokenizer,
                turn,
                "prompt",
                expected,
                ids,
                "server ids differ from rendering the whole conversation",
            )
            prompts.append((list(ids), index))
            reply = messages[index]
            out = self.reply_ids(turn, messages[:index], reply)
            self.check_parse(turn, out, reply)
            ids += out
            end = replies[turn + 1] if turn + 1 < len(replies) else len(messages)
            new = messages[index + 1 : end]
            if new:
                ids += self.family.suffix_ids(
                    self.tokenizer,
                    new,
                    self.tools,
                    enable_thinking=self.thinking,
                    previous=reply,
                    stop_id=out[-1],
                )
        return prompts


def _call_key(call: Mapping[str, Any]) -> tuple[str | None, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments else {}
    return function.get("name"), arguments


def run_case(
    family: ModelFamily, tokenizer: Tokenizer, shape: Shape, thinking: bool | str | None, system: bool
) -> CaseResult:
    """Play one shape; never raises for a family problem (it becomes a failed case)."""
    result = CaseResult(shape.name, thinking, system, "pass")
    blocked = shape.roles - family.append_roles
    if blocked:
        result.status, result.reason = (
            "skip",
            f"appends {', '.join(sorted(blocked))}, which this family does not allow",
        )
        return result
    if shape.tools and family.thinking_state(thinking) is not False and not family.tools_in_thinking:
        result.status, result.reason = "skip", "this family calls tools with thinking off only"
        return result
    run = _Run(family, tokenizer, shape.tools, thinking)
    try:
        prompts = run.play(copy.deepcopy(shape.messages), client_replies=shape.client_replies)
        result.turns = len(prompts)
        if shape.retry is not None:
            last_prompt, index = prompts[-1]
            retried = copy.deepcopy(shape.messages[:index] + shape.retry)
            result.turns += len(run.play(retried, resume=(last_prompt, index)))
        if family.template_edits:
            _check_first_turns(family, tokenizer, shape, thinking)
    except _Fail as fail:
        result.status, result.mismatch = "fail", fail.mismatch
    except FamilyError as err:
        result.status, result.mismatch = "fail", Mismatch(turn=result.turns, stage="error", detail=str(err))
    return result


def _check_first_turns(
    family: ModelFamily, tokenizer: Tokenizer, shape: Shape, thinking: bool | str | None
) -> None:
    """An edited template must render a first turn exactly as the official one does."""
    official = dataclasses.replace(family, template_edits=(), verified_templates=frozenset())
    first = next(i for i, m in enumerate(shape.messages) if m["role"] == "assistant")
    messages, tools = shape.messages[:first], shape.tools
    expected = official.render_ids(
        tokenizer, messages, tools, add_generation_prompt=True, enable_thinking=thinking
    )
    got = family.render_ids(tokenizer, messages, tools, add_generation_prompt=True, enable_thinking=thinking)
    _compare(tokenizer, 0, "official-first-turn", expected, got, "the edited template changes a first turn")


def thinking_modes(family: ModelFamily) -> list[bool | str | None]:
    """The switch values the check runs: on and off, every named mode, or the one fixed mode."""
    if family.thinking_modes:
        return list(family.thinking_modes)
    modes: dict[str, list[bool | str | None]] = {"switch": [True, False], "always": [True], "never": [None]}
    return modes[family.thinking]


def check_family(
    family: ModelFamily,
    tokenizer: Tokenizer,
    *,
    tokenizer_label: str = "",
    stand_in: str | None = None,
    compare_official: bool = True,
) -> FamilyReport:
    """Run every shape × thinking mode × (system prompt or none) for ``family`` on ``tokenizer``."""
    template = family.template(tokenizer)
    digest = sha256_text(template)
    report = FamilyReport(
        family=family.name,
        tokenizer=tokenizer_label,
        template_sha256=digest,
        template_verified=digest in family.verified_templates,
        stand_in=stand_in,
        notes=family.notes,
    )
    official = dataclasses.replace(family, template_edits=(), verified_templates=frozenset())
    for thinking in thinking_modes(family):
        for system in (True, False):
            reasons = family.thinking_state(thinking) is not False  # adaptive: replies that reason
            shapes = build_shapes(reasons, system, family.tool_call_id_style)
            for shape in shapes:
                case = run_case(family, tokenizer, shape, thinking, system)
                if compare_official and family.template_edits and case.status != "skip":
                    case.official_append_only = (
                        run_case(official, tokenizer, shape, thinking, system).status == "pass"
                    )
                report.cases.append(case)
    return report


@dataclass
class CheckTarget:
    """One run of the check: a tokenizer and, optionally, a template that replaces its own."""

    label: str
    tokenizer: Tokenizer
    template: str | None = None
    stand_in: str | None = None


def tokenizer_fidelity(tokenizer: Tokenizer, folder: str | Path) -> str | None:
    """None if ``tokenizer`` encodes like the folder's raw ``tokenizer.json``, else what differs.

    transformers can rebuild a tokenizer from its class defaults instead of the file (version 5
    does so for ``LlamaTokenizerFast``, dropping DeepSeek's byte-level pre-tokenizer); the check's
    verdict would then be about a vocabulary the engine never uses.
    """
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer as RawTokenizer

    probe = 'What is 2 + 3?\n\n  Two  spaces, tabs\tand ünïcödé 你好 <think>x</think> {"a": [1, 2]}'
    raw = RawTokenizer.from_file(str(path)).encode(probe, add_special_tokens=False).ids
    loaded = encode(tokenizer, probe)
    if raw == loaded:
        return None
    position = first_difference(raw, loaded)
    return (
        f"{type(tokenizer).__name__} encodes differently from {path} (first difference at token {position}); "
        "set tokenizer_class to PreTrainedTokenizerFast in tokenizer_config.json"
    )


def check_registered(
    name: str,
    tokenizer_dir: str | Path | None = None,
    template_file: str | Path | None = None,
    *,
    compare_official: bool = True,
) -> list[FamilyReport]:
    """Check a registered family: on its pinned artefacts and template variants, or on a given
    tokenizer folder and/or template file. One report per (tokenizer, template)."""
    from miles_envs.families.artefacts import load_tokenizer, materialise, read_pinned_text
    from miles_envs.families.registry import get_family, is_registered, registered_families

    if not is_registered(name):
        raise FamilyError(
            f"no family named {name!r} is registered (registered: {', '.join(registered_families())})"
        )
    family = get_family(name)
    template = None
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise FamilyError(f"template file {path} does not exist")
        template = path.read_text(encoding="utf-8")
    if tokenizer_dir is not None:
        folder, stand_in = Path(tokenizer_dir), None
        if not folder.is_dir():
            raise FamilyError(f"tokenizer folder {folder} does not exist")
    elif family.artefacts is not None:
        folder, stand_in = materialise(family.name, family.artefacts), family.artefacts.stand_in
    else:
        raise FamilyError(f"family {name!r} pins no offline tokenizer; give one with --tokenizer DIR")
    tokenizer = load_tokenizer(str(folder))
    targets = [CheckTarget(str(folder), tokenizer, template, stand_in)]
    if tokenizer_dir is None and template_file is None:
        for pinned in family.template_variants:
            label = f"{folder} + {pinned.package}/{pinned.path}"
            targets.append(CheckTarget(label, tokenizer, read_pinned_text(pinned), stand_in))
    fidelity = tokenizer_fidelity(tokenizer, folder)
    reports = []
    for target in targets:
        variant = (
            family if target.template is None else dataclasses.replace(family, chat_template=target.template)
        )
        report = check_family(
            variant,
            tokenizer,
            tokenizer_label=target.label,
            stand_in=target.stand_in,
            compare_official=compare_official,
        )
        report.tokenizer_problem = fidelity
        reports.append(report)
    return reports
