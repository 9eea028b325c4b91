"""The built-in multi-turn tool-calling generate function (no agent, no HTTP).

Miles itself plays the agent: it sends the prompt, runs every tool call of the reply with
the run's tool set, appends the tool results and asks again, until the model answers
without a tool call, ``agentic.max_turns`` turns have run, or the episode's tokens reach
``agentic.max_seq_len``. A tool set that raises (other than ``ToolError``, which the model
sees) fails the episode. Each turn goes through the session server's turn logic
(:func:`miles_envs.session_server.turns.complete_turn`) on an in-process linear session, so the
trajectory is assembled exactly as for an agent talking to the server over HTTP: one
sequence, loss mask 1 on sampled tokens only, log-probs and versions per token.

All turns of an episode go to one engine, the one that holds its prefix.
"""

from __future__ import annotations

import logging
import traceback

from miles.capabilities import NoOptions, declare_needs, declare_options, declare_records_routing
from miles.interfaces import RolloutContext
from miles.types import ExitReason, GenerateOutput, Sample, SamplingParams
from miles_envs.context import AgenticContext, AgenticNeeds, agentic_context
from miles_envs.rollout.episodes import episode_samples, prompt_messages
from miles_envs.session_server.turns import ContextExhausted, complete_turn
from miles_envs.sessions import LinearSession, strict
from miles_envs.tools.calculator import run_tool_calls

log = logging.getLogger("miles.rollout")


# It renders with the model family's template and keeps a session whose prefix a mid-turn weight
# change would break; it plays the agent itself, so no session server.
@declare_needs(AgenticNeeds(model_family=True, sync_only_update_modes=True))
@declare_options(NoOptions)  # reads no rollout.options (its settings are the agentic section)
@declare_records_routing  # every turn's routing, prompt suffixes included (session_server.turns)
async def multi_turn_generate(ctx: RolloutContext, sample: Sample) -> list[Sample]:
    agentic = agentic_context(ctx, "multi_turn")
    session = LinearSession(matcher=agentic.matcher or strict)
    try:
        return await _episode(ctx, agentic, session, sample)
    finally:
        ctx.router.forget(session.id)


async def _episode(
    ctx: RolloutContext, agentic: AgenticContext, session: LinearSession, sample: Sample
) -> list[Sample]:
    async def generate(input_ids: list[int], params: SamplingParams) -> GenerateOutput:
        # Every turn goes where the episode's first turn went: that engine holds its prefix.
        async with ctx.router.request(session.id, sticky=True) as route:
            if ctx.return_routed_experts:
                return await route.generate(input_ids, params, return_routed_experts=True)
            return await route.generate(input_ids, params)

    messages = prompt_messages(sample.prompt)
    tools = agentic.toolset.specs() if agentic.toolset is not None else None
    ended_by = "max_turns"
    failure = None
    prompt_tokens = cached_tokens = 0
    for _ in range(agentic.max_turns):
        try:
            result = await complete_turn(
                session,
                messages,
                tools,
                family=agentic.family,
                tokenizer=ctx.tokenizer,
                generate=generate,
                sampling=ctx.sampling,
                max_seq_len=agentic.max_seq_len,
                enable_thinking=agentic.enable_thinking,
            )
        except ContextExhausted:
            ended_by = "max_seq_len"
            break
        prompt_tokens += result.prompt_tokens
        cached_tokens += result.cached_tokens
        messages.append(result.reply.to_message())
        if result.finish_reason != "tool_calls" or agentic.toolset is None:
            ended_by = result.finish_reason
            break
        try:
            messages += await run_tool_calls(agentic.toolset, result.reply.tool_calls)
        except Exception as exc:  # a broken tool set (not a call the model got wrong): this episode fails
            ended_by, failure = "tool_error", f"the tool set raised {type(exc).__name__}: {exc}"
            log.warning("tool set failed on prompt %d:\n%s", sample.prompt.index, traceback.format_exc())
            break
    return episode_samples(
        session,
        sample,
        failure=failure,
        truncated=ended_by in ("max_turns", "max_seq_len"),
        metadata={
            "ended_by": ended_by,
            "exit_reason": str(_EXIT_REASONS.get(ended_by, ExitReason.COMPLETED)),
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
        },
    )


# How each ``ended_by`` counts among the typed exit reasons (``rollout/exit/<reason>``).
_EXIT_REASONS: dict[str, ExitReason] = {
    "max_turns": ExitReason.TURN_LIMIT,
    "max_seq_len": ExitReason.TOKEN_LIMIT,
    "length": ExitReason.TOKEN_LIMIT,
    "tool_error": ExitReason.TOOL_ERROR,
    "abort": ExitReason.ENVIRONMENT_ERROR,  # the engine aborted the turn (the sample is ABORTED)
}
