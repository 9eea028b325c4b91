"""The built-in agentic generate function: an agent function drives the episode through the
session server.

For each trajectory it opens a session on the run's session server, calls the agent
function with the session's base URL (the agent talks OpenAI chat completions to it, with
any client, as a black box), then closes the session and turns what the server recorded into
samples: one for a linear session, one per selected leaf for a branching one. The server,
not the agent, decided every token, so the samples hold exactly what the policy sampled.

An agent that raises, or runs past ``agentic.agent_timeout_s`` (it is then cancelled), fails
its trajectory (not rewarded, the reason in the sample's metadata); the run goes on. What the
agent returns (:class:`~miles.interfaces.AgentResult`, a dict with the same keys, or None) is
merged into each sample's metadata; its ``reward`` is kept as ``metadata["agent_reward"]``
for the ``agent`` reward.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from typing import Any

from miles.capabilities import NoOptions, declare_needs, declare_options, declare_records_routing
from miles.errors import ComponentError, ConfigError
from miles.interfaces import RolloutContext
from miles.types import INFRA_EXIT_REASONS, ExitReason, Sample, SamplingParams, Status
from miles_envs.context import AgenticNeeds, agentic_context
from miles_envs.interfaces import AgentResult, AgentTask
from miles_envs.rewards import AGENT_REWARD
from miles_envs.rollout.episodes import episode_samples, prompt_messages

log = logging.getLogger("miles.rollout")


# The agent reaches the engines through the run's session server (linear or branching sessions).
@declare_needs(
    AgenticNeeds(model_family=True, session_server=True, sync_only_update_modes=True, branching=True)
)
@declare_options(NoOptions)  # reads no rollout.options (its settings are the agentic section)
@declare_records_routing  # the session server records every turn's routing when the run asks
async def agentic_generate(ctx: RolloutContext, sample: Sample) -> list[Sample]:
    agentic = agentic_context(ctx, "agentic")
    if agentic.server is None or agentic.agent is None:
        raise ConfigError("rollout.generate_fn 'agentic' needs the session server and agentic.agent")
    service = agentic.server
    session_id, base_url = service.open()
    task = AgentTask(
        base_url=base_url,
        messages=prompt_messages(sample.prompt),
        tools=agentic.toolset.specs() if agentic.toolset is not None else None,
        request=_request_defaults(ctx.sampling),
        label=sample.prompt.label,
        metadata=dict(sample.prompt.metadata),
        toolset=agentic.toolset,
        max_turns=agentic.max_turns,
        options=dict(agentic.agent_options),
    )
    failure = None
    exit_reason: ExitReason | None = None
    result = AgentResult()
    try:
        result = as_agent_result(await asyncio.wait_for(agentic.agent(task), agentic.agent_timeout_s))
        failure, exit_reason = result.failure, result.exit_reason
    except TimeoutError:
        failure = f"the agent ran longer than agentic.agent_timeout_s ({agentic.agent_timeout_s} s)"
        exit_reason = ExitReason.WALL_CLOCK
        log.warning("agent timed out on prompt %d", sample.prompt.index)
    except Exception as exc:
        failure = f"the agent raised {type(exc).__name__}: {exc}"
        exit_reason = ExitReason.AGENT_ERROR
        log.warning("agent failed on prompt %d:\n%s", sample.prompt.index, traceback.format_exc())
    finally:
        closed = service.close(session_id)
    metadata = dict(result.metadata)
    if result.reward is not None:
        metadata[AGENT_REWARD] = float(result.reward)
    usage = closed.usage
    if exit_reason is None:
        exit_reason = (
            ExitReason.TOKEN_LIMIT
            if usage.exhausted
            else ExitReason.AGENT_ERROR
            if failure
            else ExitReason.COMPLETED
        )
    metadata |= {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "exit_reason": str(exit_reason),
    }
    samples = episode_samples(
        closed.session,
        sample,
        selection=agentic.leaf_selection,
        truncated=usage.exhausted,
        failure=failure,
        metadata=metadata,
    )
    if exit_reason in INFRA_EXIT_REASONS:
        # Not the policy's doing: the group is dropped (and its prompt retried), never scored.
        for s in samples:
            s.status, s.reward = Status.ABORTED, None
            s.metadata.setdefault("failure", failure or str(exit_reason))
    return samples


def _request_defaults(sampling: SamplingParams) -> dict[str, Any]:
    """The recipe's sampling as chat-completion arguments (OpenAI names) the agent passes on."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_new_tokens,
    }


def as_agent_result(value: Any) -> AgentResult:
    """An agent's return value as an ``AgentResult`` (it may return one, a dict of its fields, or None)."""
    if value is None:
        return AgentResult()
    if isinstance(value, AgentResult):
        if value.exit_reason is not None:
            value.exit_reason = _exit_reason(value.exit_reason)
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"reward", "metadata", "failure", "exit_reason"})
        if unknown:
            raise ComponentError(
                f"an agent returned unknown keys {unknown}; allowed: reward, metadata, failure, exit_reason"
            )
        value = dict(value)
        if value.get("exit_reason") is not None:
            value["exit_reason"] = _exit_reason(value["exit_reason"])
        return AgentResult(**value)
    raise ComponentError(f"an agent must return an AgentResult, a dict or None, not {type(value).__name__}")


def _exit_reason(value: Any) -> ExitReason:
    try:
        return ExitReason(value)
    except ValueError:
        raise ComponentError(
            f"an agent returned exit_reason {value!r}; known: {', '.join(r.value for r in ExitReason)}"
        ) from None
