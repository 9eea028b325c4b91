"""Checkpoints (one per completed generation) and plans (which checkpoint a request extends).

A checkpoint records one turn: the messages the request added after its parent's path,
the assistant message the server parsed from the output, and the exact tokens: the
prompt suffix the server tokenized for this turn (for a first turn: the whole rendered
prompt) and the engine's output ids with their log-probabilities, weight versions and,
for MoE models, routed experts. The token sequence of a checkpoint is its parent's
sequence + its suffix + its output, so a session's tokens are append-only by
construction: nothing is ever re-tokenized.

Checkpoints are immutable and never deleted: a linear session drops a retried one from
its sequence, a branching session keeps every one in its tree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_envs.sessions.errors import MessageError
from miles_envs.sessions.messages import Message

# The engine's stop reasons, plus OpenAI's name for a stop that ended in tool calls.
FINISH_REASONS = ("stop", "tool_calls", "length", "abort")

# A log-probability above this is not one (0 plus float rounding is fine).
_LOGPROB_SLACK = 1e-4

# Expert ids of one token: [layer][k].
ExpertRow = list[list[int]]


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One completed generation in a session (immutable; compared by identity)."""

    id: int  # increasing within the session: creation order
    parent: Checkpoint | None
    new_messages: tuple[Message, ...]  # what the request added after the parent's path
    assistant: Message  # the reply, as the server parsed it from the output tokens
    prompt_suffix_ids: tuple[int, ...]  # tokens appended before generating (root: the first render)
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    weight_versions: tuple[int, ...]  # per output token
    prefill_version: int  # the version the suffix was prefilled under (see ``make_checkpoint``)
    finish_reason: str
    # Per output token / per suffix token: the experts of the forward pass that produced it.
    routed_experts: list[ExpertRow] | None = None
    suffix_routed_experts: list[ExpertRow] | None = None
    created_at: float = field(default_factory=time.time)
    # Derived from the parent (set by ``make_checkpoint``), so path lookups need no walk.
    depth: int = 1
    num_messages: int = 0
    num_tokens: int = 0

    @property
    def turn_messages(self) -> tuple[Message, ...]:
        """This turn's messages: the request's new ones, then the reply."""
        return (*self.new_messages, self.assistant)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @property
    def start(self) -> int:
        """Index of this turn's first message in the path's message list."""
        return self.num_messages - len(self.new_messages) - 1

    def path(self) -> list[Checkpoint]:
        """The checkpoints from the root to this one."""
        out: list[Checkpoint] = []
        node: Checkpoint | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def path_messages(self) -> list[Message]:
        """The recorded message list this checkpoint ends (its last message is the reply)."""
        out: list[Message] = []
        for node in self.path():
            out += node.turn_messages
        return out

    def token_ids(self) -> list[int]:
        """The full token sequence: every suffix and output from the root, in order."""
        out: list[int] = []
        for node in self.path():
            out += node.prompt_suffix_ids
            out += node.output_ids
        return out


@dataclass(frozen=True, eq=False)
class Plan:
    """Where a request attaches: the checkpoint it extends and the messages that are new.

    The HTTP layer renders ``new_messages`` after ``history`` (the *recorded* messages,
    which stay authoritative over what the agent replayed) into ``prompt_suffix_ids``, sends
    ``prefix_ids + prompt_suffix_ids`` to the engine, then commits the result. With no
    parent, the request starts the sequence: render all of ``messages`` as the first prompt.
    """

    session_id: str
    parent: Checkpoint | None
    messages: tuple[Message, ...]  # the whole request, normalised
    # Linear sessions: the most recent checkpoint, which this retry replaces once committed.
    replaces: Checkpoint | None = None

    @property
    def new_messages(self) -> tuple[Message, ...]:
        start = self.parent.num_messages if self.parent is not None else 0
        return self.messages[start:]

    @property
    def history(self) -> list[Message]:
        return self.parent.path_messages() if self.parent is not None else []

    @property
    def prefix_ids(self) -> list[int]:
        return self.parent.token_ids() if self.parent is not None else []


def make_checkpoint(
    *,
    id: int,
    parent: Checkpoint | None,
    new_messages: tuple[Message, ...],
    prompt_suffix_ids: Sequence[int],
    output_ids: Sequence[int],
    output_logprobs: Sequence[float],
    weight_versions: Sequence[int],
    finish_reason: str,
    assistant_message: Message | Mapping[str, Any],
    weight_version: int | None = None,
    routed_experts: list[ExpertRow] | None = None,
    suffix_routed_experts: list[ExpertRow] | None = None,
) -> Checkpoint:
    """Validate one generation's results and build its checkpoint (see ``Session.commit``)."""
    suffix = _token_ids(prompt_suffix_ids, "prompt_suffix_ids")
    if parent is None and not suffix:
        raise ValueError("the first turn's prompt_suffix_ids (the whole rendered prompt) is empty")
    output = _token_ids(output_ids, "output_ids")
    logprobs = tuple(float(x) for x in output_logprobs)
    if len(logprobs) != len(output):
        raise ValueError(f"output_logprobs has {len(logprobs)} entries for {len(output)} output tokens")
    # Finite and <= 0, with room for float rounding: an inf or NaN would poison the importance ratio.
    if not all(math.isfinite(x) and x <= _LOGPROB_SLACK for x in logprobs):
        raise ValueError("output_logprobs must be finite log-probabilities (<= 0)")
    versions = _versions(weight_versions, "weight_versions")
    if len(versions) != len(output):
        raise ValueError(f"weight_versions has {len(versions)} entries for {len(output)} output tokens")
    if weight_version is not None:
        weight_version = _versions([weight_version], "weight_version")[0]
    if versions:
        prefill_version = versions[0]
    elif weight_version is not None:
        prefill_version = weight_version
    else:
        raise ValueError("the generation produced no tokens: give weight_version (the engine's version)")
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {', '.join(FINISH_REASONS)}; got {finish_reason!r}")
    try:
        assistant = Message.from_openai(assistant_message)
    except MessageError as err:
        raise ValueError(f"assistant_message: {err}") from None
    if assistant.role != "assistant":
        raise ValueError(f"assistant_message must have role 'assistant', got {assistant.role!r}")
    _check_rows(routed_experts, len(output), "routed_experts", "output tokens")
    _check_rows(suffix_routed_experts, len(suffix), "suffix_routed_experts", "prompt suffix tokens")
    return Checkpoint(
        id=id,
        parent=parent,
        new_messages=new_messages,
        assistant=assistant,
        prompt_suffix_ids=suffix,
        output_ids=output,
        output_logprobs=logprobs,
        weight_versions=versions,
        prefill_version=prefill_version,
        finish_reason=finish_reason,
        routed_experts=routed_experts,
        suffix_routed_experts=suffix_routed_experts,
        depth=(parent.depth if parent else 0) + 1,
        num_messages=(parent.num_messages if parent else 0) + len(new_messages) + 1,
        num_tokens=(parent.num_tokens if parent else 0) + len(suffix) + len(output),
    )


def expert_shape(rows: list[ExpertRow] | None) -> tuple[int, int] | None:
    """(layers, top-k) of routed-expert rows, or None when there are none."""
    if not rows:
        return None
    return len(rows[0]), len(rows[0][0]) if rows[0] else 0


def _token_ids(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(values)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{what} must be non-negative integer token ids; found {t!r}")
    return out


def _versions(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{what} must be integer weight versions; found {v!r}")
    return out


def _check_rows(rows: list[ExpertRow] | None, n: int, what: str, of: str) -> None:
    if rows is None:
        return
    if len(rows) != n:
        raise ValueError(f"{what} has {len(rows)} rows for {n} {of}")
    shape = expert_shape(rows)
    for i, row in enumerate(rows):
        if len(row) != shape[0] or any(len(layer) != shape[1] for layer in row):  # type: ignore[index]
            raise ValueError(f"{what}: row {i} is not [{shape[0]} layers][{shape[1]} experts] like row 0")  # type: ignore[index]
