"""The agentic generate function through a real session server on two real engines (serving the
trained calculator model): routing affinity and the engines' prefix cache, the token limit, agent
failures and rewards, and branching sessions."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from engine.helpers import running_engine

from agentic.scripted_model import PAIRS, script_episode
from miles.builtins.rewards.exact_match import exact_match
from miles.builtins.rollout.default import GroupRollout
from miles.engines.client import SGLangClient
from miles.interfaces import RolloutContext
from miles.types import Group, Prompt, SamplingParams, Status
from miles_envs.agents import tool_agent
from miles_envs.context import AgenticContext
from miles_envs.interfaces import AgentResult, AgentTask
from miles_envs.rewards import agent_reward
from miles_envs.session_server.app import ServerState
from miles_envs.session_server.service import session_service
from miles_envs.sessions import SessionStore
from miles_envs.tools.calculator import Calculator

pytestmark = pytest.mark.slow

SAMPLING = SamplingParams(max_new_tokens=40, temperature=1.0)


@pytest.fixture(scope="module")
def two_engines(tool_model, tmp_path_factory) -> Iterator[list[str]]:
    _, _, model_dir = tool_model
    logs = tmp_path_factory.mktemp("two-engines")
    with running_engine(model_dir, logs / "a") as a, running_engine(model_dir, logs / "b") as b:
        yield [a, b]


@contextlib.contextmanager
def _server(tool_model, urls: list[str], *, mode: str = "linear", max_seq_len: int | None = None):
    family, tokenizer, _ = tool_model
    state = ServerState(
        store=SessionStore(mode=mode),
        family=family,
        tokenizer=tokenizer,
        engines=[SGLangClient(url) for url in urls],
        sampling=SAMPLING,
        max_seq_len=max_seq_len,
    )
    with session_service(state) as service:
        yield service


def _rollout(tool_model, service, prompts: list[Prompt], agent, *, reward=exact_match, n: int = 1, **agentic):
    family, tokenizer, _ = tool_model

    async def go() -> list[Group]:
        ctx = RolloutContext(
            engines=[],
            tokenizer=tokenizer,
            sampling=SAMPLING,
            n_samples_per_prompt=n,
            reward=reward,
            services={
                "agentic": AgenticContext(
                    family=family,
                    session_mode=service.state.store.mode,
                    toolset=Calculator(),
                    agent=agent,
                    server=service,
                    **agentic,
                )
            },
        )
        return await GroupRollout(generate_fn="agentic")(ctx, prompts)

    return asyncio.run(go())


def _prompt(index: int, a: int, b: int) -> Prompt:
    return Prompt(index=index, prompt=f"What is {a}+{b}?", label=str(a + b))


def _script_ids(tool_model, a: int, b: int) -> list[int]:
    family, tokenizer, _ = tool_model
    script = script_episode(family, tokenizer, a, b)
    return [*script.reply1, *script.suffix, *script.reply2]


def test_sessions_stick_to_their_engine_and_the_second_turn_reuses_its_prefix(tool_model, two_engines):
    cached: list[list[int]] = []

    async def agent(task: AgentTask) -> AgentResult:
        import openai

        async with openai.AsyncOpenAI(base_url=task.base_url, api_key="unused", max_retries=0) as client:
            messages = list(task.messages)
            seen = []
            while True:
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, tools=task.tools, **task.request
                )
                seen.append(reply.usage.prompt_tokens_details.cached_tokens)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                calls = [c.model_dump() for c in reply.choices[0].message.tool_calls or []]
                if not calls:
                    break
                from miles_envs.tools.calculator import run_tool_calls

                messages += await run_tool_calls(task.toolset, calls)
        cached.append(seen)
        return AgentResult(metadata={"cached": seen})

    prompts = [_prompt(i, a, b) for i, (a, b) in enumerate(PAIRS[:4])]
    with _server(tool_model, two_engines) as service:
        groups = _rollout(tool_model, service, prompts, agent)
        metrics = service.state.router.metrics()
        assert len(service.state.store) == 0  # every session was closed
    for group, (a, b) in zip(groups, PAIRS[:4], strict=True):
        (sample,) = group.samples
        assert sample.response_ids == _script_ids(tool_model, a, b)
        assert sample.status is Status.COMPLETED and sample.reward == 1.0
        first, second = sample.metadata["cached"]
        # Turn 2 extends turn 1 on the same engine: everything turn 1 consumed comes from the cache.
        script = script_episode(*tool_model[:2], a, b)
        assert second == len(script.prompt1) + len(script.reply1) - 1
        assert first < second
        assert sample.metadata["cached_tokens"] == first + second  # the server's count of the session
        assert sample.metadata["prompt_tokens"] == 2 * len(script.prompt1) + len(script.reply1) + len(
            script.suffix
        )
    # The four sessions were spread over both engines, and every key was forgotten at the end.
    assert metrics["router/keys"] == 0
    assert metrics["router/engine0/routed"] > 0 and metrics["router/engine1/routed"] > 0


def test_running_out_of_tokens_is_truncated(tool_model, two_engines):
    a, b = PAIRS[1]
    script = script_episode(*tool_model[:2], a, b)
    limit = len(script.prompt1) + len(script.reply1) + len(script.suffix)  # no room for the second reply
    with _server(tool_model, two_engines, max_seq_len=limit) as service:
        (group,) = _rollout(tool_model, service, [_prompt(0, a, b)], tool_agent)
    (sample,) = group.samples
    assert sample.response_ids == list(script.reply1)
    assert sample.status is Status.TRUNCATED
    assert sample.metadata["agent_ended_by"] == "context_length_exceeded"


def test_a_failing_agent_fails_its_trajectory_and_agent_rewards_are_used(tool_model, two_engines):
    async def crashing(task: AgentTask) -> None:
        await tool_agent(AgentTask(**{**task.__dict__, "max_turns": 1}))
        raise RuntimeError("the agent's sandbox died")

    async def self_judging(task: AgentTask) -> dict[str, Any]:
        result = await tool_agent(task)
        return {"reward": 0.25, "metadata": result.metadata}

    with _server(tool_model, two_engines) as service:
        (failed,) = _rollout(tool_model, service, [_prompt(0, *PAIRS[2])], crashing)
        (judged,) = _rollout(tool_model, service, [_prompt(1, *PAIRS[2])], self_judging, reward=agent_reward)
    (sample,) = failed.samples
    assert sample.status is Status.FAILED and sample.reward is None
    assert "the agent's sandbox died" in sample.metadata["failure"]
    assert len(sample.response_ids) > 0  # the turn it ran is still recorded (and reported failed)
    (sample,) = judged.samples
    assert sample.status is Status.COMPLETED and sample.reward == 0.25


def test_an_agent_past_its_time_limit_is_cancelled_and_fails(tool_model, two_engines):
    cancelled = []

    async def slow(task: AgentTask) -> None:
        await tool_agent(AgentTask(**{**task.__dict__, "max_turns": 1}))
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with _server(tool_model, two_engines) as service:
        (group,) = _rollout(tool_model, service, [_prompt(0, *PAIRS[0])], slow, agent_timeout_s=2.0)
        assert len(service.state.store) == 0
    (sample,) = group.samples
    assert cancelled == [True]
    assert sample.status is Status.FAILED and "agent_timeout_s" in sample.metadata["failure"]


def test_a_branching_session_yields_one_sample_per_leaf(tool_model, two_engines):
    """The agent asks the first question twice (a retry that the branching rule keeps as a second
    leaf, ``leaf_selection: all``), then finishes the episode: two samples take the attempt's place."""

    async def retrying(task: AgentTask) -> None:
        import openai

        async with openai.AsyncOpenAI(base_url=task.base_url, api_key="unused", max_retries=0) as client:
            await client.chat.completions.create(model="policy", messages=task.messages, tools=task.tools)
        await tool_agent(task)

    a, b = PAIRS[3]
    with _server(tool_model, two_engines, mode="branching") as service:
        (group,) = _rollout(tool_model, service, [_prompt(0, a, b)], retrying, leaf_selection="all")
    samples = group.samples
    assert len(samples) == 2 and [s.group_index for s in samples] == [0, 1]
    script = script_episode(*tool_model[:2], a, b)
    by_length = sorted(samples, key=lambda s: len(s.response_ids))
    assert by_length[0].response_ids == list(script.reply1)
    assert by_length[1].response_ids == _script_ids(tool_model, a, b)
    assert all(s.metadata["session_mode"] == "branching" for s in samples)
