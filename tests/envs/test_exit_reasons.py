"""Typed exit reasons through the core's agentic generate function and a real session server:
what an agent reports is kept per sample, infrastructure failures are ABORTED (the buffer drops
the group and returns its prompt for a retry, it is never scored), and every step counts them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from miles.builtins.buffer import FifoBuffer
from miles.builtins.rollout.default import GroupRollout
from miles.driver.generation import rollout_metrics
from miles.engines.client import SGLangClient
from miles.errors import ComponentError
from miles.interfaces import BufferPolicy, RolloutContext
from miles.types import ExitReason, Group, Prompt, SamplingParams, Status
from miles_envs.context import AgenticContext
from miles_envs.families import get_family
from miles_envs.interfaces import AgentResult, AgentTask
from miles_envs.rewards import agent_reward
from miles_envs.rollout.agentic import as_agent_result
from miles_envs.session_server.app import ServerState
from miles_envs.session_server.service import session_service
from miles_envs.sessions import SessionStore

SAMPLING = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from miles.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen3"))
    state = ServerState(
        store=SessionStore(mode="linear"),
        family=get_family("generic"),
        tokenizer=tokenizer,
        # These agents end before any model call (as one whose sandbox never started): the engine
        # client is never used, so it points at a closed port.
        engines=[SGLangClient("http://127.0.0.1:9")],
        sampling=SAMPLING,
    )
    with session_service(state) as service:
        yield service


def rollout(service: Any, agent: Any, n: int = 2, **agentic: Any) -> list[Group]:
    async def go() -> list[Group]:
        ctx = RolloutContext(
            engines=[],
            tokenizer=service.state.tokenizer,
            sampling=SAMPLING,
            n_samples_per_prompt=n,
            reward=agent_reward,
            services={
                "agentic": AgenticContext(family=service.state.family, agent=agent, server=service, **agentic)
            },
        )
        return await GroupRollout(generate_fn="agentic")(ctx, [Prompt(index=7, prompt="do it")])

    return asyncio.run(go())


def test_infrastructure_failures_are_aborted_and_retried_not_scored(server: Any) -> None:
    async def died(task: AgentTask) -> AgentResult:
        return AgentResult(exit_reason=ExitReason.SANDBOX_DIED, failure="sandbox creation failed")

    (group,) = rollout(server, died)
    for sample in group.samples:
        assert sample.status is Status.ABORTED and sample.reward is None
        assert sample.metadata["exit_reason"] == "sandbox_died"
        assert sample.metadata["failure"] == "sandbox creation failed"
    recycled: list[Group] = []
    buffer = FifoBuffer(BufferPolicy(retry_aborted=True, recycle=lambda p: recycled.append(p)))
    buffer.put(group)
    assert [p.index for p in recycled] == [7] and buffer.take(1, weight_version=0, timeout_s=0) == []
    metrics = rollout_metrics([group], [], {"aborted": 1}, 1.0)
    assert metrics["rollout/exit/sandbox_died"] == 2.0


def test_reported_reasons_and_the_generate_functions_own(server: Any) -> None:
    async def limited(task: AgentTask) -> dict[str, Any]:
        return {"exit_reason": "turn_limit", "reward": 0.0, "metadata": {"tool_time_s": 0.25}}

    async def broken(task: AgentTask) -> None:
        raise RuntimeError("bug in the agent")

    async def slow(task: AgentTask) -> None:
        await asyncio.sleep(5)

    (g1,) = rollout(server, limited)
    (g2,) = rollout(server, broken)
    (g3,) = rollout(server, slow, n=1, agent_timeout_s=0.2)
    assert [s.metadata["exit_reason"] for s in g1.samples] == ["turn_limit"] * 2
    assert [s.metadata["exit_reason"] for s in g2.samples] == ["agent_error"] * 2
    assert [s.metadata["exit_reason"] for s in g3.samples] == ["wall_clock_timeout"]
    # Not infrastructure: these are the policy's (or the agent's) doing and stay in the batch.
    assert all(s.status is not Status.ABORTED for g in (g1, g2, g3) for s in g.samples)
    metrics = rollout_metrics([g1, g2, g3], [g1, g2, g3], {}, 1.0)
    assert metrics["rollout/exit/turn_limit"] == 2.0
    assert metrics["rollout/exit/agent_error"] == 2.0
    assert metrics["rollout/exit/wall_clock_timeout"] == 1.0
    assert metrics["rollout/episode/tool_time_s_total"] == pytest.approx(0.5)


def test_an_unknown_exit_reason_is_refused() -> None:
    with pytest.raises(ComponentError, match="exit_reason 'tired'"):
        as_agent_result({"exit_reason": "tired"})
    assert as_agent_result({"exit_reason": "no_response"}).exit_reason is ExitReason.NO_RESPONSE
