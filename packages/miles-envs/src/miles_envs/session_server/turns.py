"""One chat turn of a session, token in and token out: the server's work, without HTTP.

The session server's chat-completions route and the in-process multi-turn generate function
both run a turn through :func:`complete_turn`, so an episode driven over HTTP by a black-box
agent and one driven by Miles itself record exactly the same tokens:

1. the session plans the turn (which recorded checkpoint the messages replay, which are new);
2. a first turn renders the family's chat template; a later one appends only the new messages
   (``suffix_ids``) to the checkpoint's prompt and output ids;
3. the engine generates from those ids;
4. the family parses the output into an assistant message, and the session records the
   checkpoint (prompt suffix, output ids, log-probs, versions, routed experts: the output's and,
   when the engine returned the prompt's, the suffix's).

A plan that fails before its commit is abandoned (the session context manager does it), so
a failed turn leaves the session as it was.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from miles.routing import NOT_RECORDED
from miles.types import GenerateOutput, SamplingParams
from miles_envs.families.base import ParsedReply, Thinking
from miles_envs.sessions import Checkpoint, Session, SessionError
from miles_envs.sessions.checkpoints import ExpertRow, expert_shape

# Sends input ids to an engine (the caller routes it) and returns what the engine generated.
Generate = Callable[[list[int], SamplingParams], Awaitable[GenerateOutput]]


class ContextExhausted(SessionError):
    """The conversation already fills the token limit; the turn was not run."""

    code = "context_length_exceeded"


@dataclass
class TurnResult:
    """A completed turn: the parsed reply, its finish reason and token counts."""

    reply: ParsedReply
    finish_reason: str  # stop | tool_calls | length | abort
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    checkpoint: Checkpoint


async def complete_turn(
    session: Session,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    family: Any,
    tokenizer: Any,
    generate: Generate,
    sampling: SamplingParams,
    max_seq_len: int | None = None,
    enable_thinking: Thinking = None,
) -> TurnResult:
    """Run one turn of ``session`` for ``messages`` (OpenAI dicts) and record it.

    ``sampling`` is used as given, plus the family's stop tokens. ``max_seq_len`` caps prompt
    plus output tokens: the turn may generate only what is left of it; with nothing left it
    raises :class:`ContextExhausted` and records nothing (the trajectory so far is kept, and
    its owner reports it truncated). ``enable_thinking`` is the family's thinking switch for
    this turn (None: the template's default): it renders the new messages and the generation
    prompt, and tells the reasoning parser whether the output starts inside the reasoning.
    """
    tool_list = list(tools) if tools else None
    with session.turn(messages) as plan:
        if plan.parent is None:
            prefix: list[int] = []
            suffix = family.render_ids(
                tokenizer, messages, tool_list, add_generation_prompt=True, enable_thinking=enable_thinking
            )
        else:
            prefix = plan.prefix_ids  # a fresh list: the checkpoint's prompt and output ids
            suffix = family.suffix_ids(
                tokenizer,
                [m.to_openai() for m in plan.new_messages],
                tool_list,
                add_generation_prompt=True,
                enable_thinking=enable_thinking,
                previous=plan.parent.assistant.to_openai(),  # its tool calls shape the boundary
                stop_id=prefix[-1] if prefix else None,
            )
        input_ids = prefix + list(suffix)
        params = replace(sampling, stop_token_ids=list(family.stop_token_ids(tokenizer)))
        if max_seq_len is not None:
            params.max_new_tokens = min(params.max_new_tokens, max_seq_len - len(input_ids))
        if params.max_new_tokens <= 0:
            raise ContextExhausted(
                f"the conversation has {len(input_ids)} tokens and the limit is {max_seq_len} "
                "(prompt and replies together): nothing is left to generate"
            )
        out = await generate(input_ids, params)
        reply = family.parse_reply(
            tokenizer, out.output_ids, tools=tool_list, enable_thinking=enable_thinking
        )
        finish = finish_reason(out.finish_reason, reply)
        checkpoint = session.commit(
            plan,
            prompt_suffix_ids=suffix,
            output_ids=out.output_ids,
            output_logprobs=out.output_logprobs,
            weight_versions=out.token_versions(),
            finish_reason=finish,
            assistant_message=reply.to_message(),
            weight_version=out.weight_version,
            routed_experts=out.routed_experts,
            suffix_routed_experts=suffix_routing(out, len(prefix), len(suffix)),
        )
    return TurnResult(
        reply=reply,
        finish_reason=finish,
        prompt_tokens=len(input_ids),
        completion_tokens=len(out.output_ids),
        cached_tokens=out.cached_tokens,
        checkpoint=checkpoint,
    )


def suffix_routing(out: GenerateOutput, prefix_len: int, suffix_len: int) -> list[ExpertRow] | None:
    """The routing of the forward passes that produced this turn's suffix tokens, from the engine's
    prompt rows (None when it returned none).

    Suffix token ``i`` sits at position ``prefix_len + i`` and was produced by the forward at the
    position before it, so the rows are the prompt's from ``prefix_len - 1`` on: the first is the
    routing of the previous turn's last output token, which that turn never fed to the model. A first
    turn's first token was produced by no forward pass; its row is ``-1`` (not recorded) and the
    trajectory turns the rest into ``Sample.prompt_routed_experts``.
    """
    rows = out.prompt_routed_experts
    if rows is None:
        return None
    if prefix_len:
        return [[list(layer) for layer in row] for row in rows[prefix_len - 1 : prefix_len - 1 + suffix_len]]
    shape = expert_shape(rows) or expert_shape(out.routed_experts)
    if shape is None:  # a one-token prompt and no output: nothing tells the shape, nothing to replay
        return None
    layers, topk = shape
    return [[[NOT_RECORDED] * topk for _ in range(layers)], *rows]


def finish_reason(engine_reason: str, reply: ParsedReply) -> str:
    """The OpenAI finish reason of a turn: the engine's length or abort, else tool_calls or stop."""
    if engine_reason in ("length", "abort"):
        return engine_reason
    return "tool_calls" if reply.tool_calls else "stop"
