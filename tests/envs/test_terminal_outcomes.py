"""The terminal-task episode loop's exit reasons, limits and infrastructure handling, in a real
sandbox. The policy is a scripted agent (a list of replies), so each exit reason is reached on
purpose; the commands it sends really run."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import Any

import pytest

from miles.errors import ConfigError
from miles.types import ExitReason
from miles_envs.sandbox import IsolationReport, Sandbox, SandboxError, SandboxSpec
from miles_envs.sandbox.local import LocalProvider
from miles_envs.terminal import EpisodeLimits, EpisodeOutcome, PolicyReply, load_tasks, run_episode
from miles_envs.terminal.agent import TerminalAgentOptions, episode_options, solve
from miles_envs.terminal.episode import Policy, PolicyUnavailableError
from miles_envs.terminal.task import TerminalTask

from .conftest import FAST

HELLO = next(t for t in load_tasks("builtin") if t.id == "hello-file")


def shell(command: str, call_id: str = "c0") -> PolicyReply:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "shell", "arguments": json.dumps({"command": command})},
    }
    return PolicyReply(
        message={"role": "assistant", "content": None, "tool_calls": [call]},
        finish_reason="tool_calls",
        completion_tokens=10,
    )


def say(text: str, finish_reason: str = "stop") -> PolicyReply:
    return PolicyReply(
        message={"role": "assistant", "content": text}, finish_reason=finish_reason, completion_tokens=3
    )


def scripted(
    replies: Iterable[PolicyReply | Exception], seen: list[list[dict[str, Any]]] | None = None
) -> Policy:
    queue = list(replies)

    async def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        assert tools[0]["function"]["name"] == "shell"
        if seen is not None:
            seen.append([dict(m) for m in messages])
        item = queue.pop(0) if queue else shell("true")
        if isinstance(item, Exception):
            raise item
        return item

    return policy


def episode(
    provider: LocalProvider, policy: Policy, limits: EpisodeLimits, task: TerminalTask = HELLO
) -> EpisodeOutcome:
    async def go() -> EpisodeOutcome:
        sandbox = await provider.create(SandboxSpec(files=dict(task.files), limits=FAST))
        try:
            return await run_episode(policy, task, sandbox, limits)
        finally:
            await sandbox.close()

    return asyncio.run(go())


SOLVE = "printf 'Hello, world!\\n' > hello.txt"


def test_completed_episode_is_rewarded_by_the_test_script(provider: LocalProvider) -> None:
    seen: list[list[dict[str, Any]]] = []
    out = episode(provider, scripted([shell(SOLVE), say("done")], seen), EpisodeLimits())
    assert (out.exit_reason, out.reward, out.turns, out.tool_calls) == (ExitReason.COMPLETED, 1.0, 2, 1)
    assert out.tool_time_s > 0 and out.test_exit_code == 0
    tool_message = seen[1][-1]
    assert tool_message["role"] == "tool" and tool_message["content"].startswith("exit code: 0")


def test_a_wrong_answer_completes_with_reward_zero(provider: LocalProvider) -> None:
    out = episode(provider, scripted([shell("echo nope > hello.txt"), say("done")]), EpisodeLimits())
    assert (out.exit_reason, out.reward) == (ExitReason.COMPLETED, 0.0)
    assert out.test_exit_code not in (0, None)


def test_turn_limit_still_grades_what_was_done(provider: LocalProvider) -> None:
    out = episode(provider, scripted([shell(SOLVE), shell("ls"), shell("ls")]), EpisodeLimits(max_turns=2))
    assert (out.exit_reason, out.reward, out.turns) == (ExitReason.TURN_LIMIT, 1.0, 2)


def test_token_limits(provider: LocalProvider) -> None:
    out = episode(provider, scripted([shell("ls"), shell("ls")]), EpisodeLimits(max_tokens=15))
    assert (out.exit_reason, out.turns, out.completion_tokens) == (ExitReason.TOKEN_LIMIT, 2, 20)
    out = episode(provider, scripted([say("I will wri", finish_reason="length")]), EpisodeLimits())
    assert (out.exit_reason, out.reward) == (ExitReason.TOKEN_LIMIT, 0.0)


def test_no_response_and_format_errors(provider: LocalProvider) -> None:
    assert episode(provider, scripted([say("  ")]), EpisodeLimits()).exit_reason is ExitReason.NO_RESPONSE
    bad_json = shell("x")
    bad_json.message["tool_calls"][0]["function"]["arguments"] = "{not json"
    other_tool = shell("x")
    other_tool.message["tool_calls"][0]["function"]["name"] = "python"
    for reply in (bad_json, other_tool):
        out = episode(provider, scripted([reply]), EpisodeLimits())
        assert out.exit_reason is ExitReason.FORMAT_ERROR and out.reward == 0.0, out


def test_tool_timeouts_are_tolerated_up_to_the_budget(provider: LocalProvider) -> None:
    limits = EpisodeLimits(command_timeout_s=0.3, tool_timeout_budget=1)
    out = episode(provider, scripted([shell("sleep 5"), shell(SOLVE), say("done")]), limits)
    assert (out.exit_reason, out.tool_timeouts, out.reward) == (ExitReason.COMPLETED, 1, 1.0)
    out = episode(provider, scripted([shell("sleep 5"), shell("sleep 5"), shell(SOLVE)]), limits)
    assert (out.exit_reason, out.tool_timeouts, out.turns) == (ExitReason.TOOL_ERROR, 2, 2)


def test_wall_clock_covers_model_calls_and_commands(provider: LocalProvider) -> None:
    async def slow(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        await asyncio.sleep(5)
        return say("late")

    t0 = time.monotonic()
    out = episode(provider, slow, EpisodeLimits(wall_clock_s=0.3))
    assert out.exit_reason is ExitReason.WALL_CLOCK and out.reward == 0.0
    out = episode(
        provider, scripted([shell("sleep 5")]), EpisodeLimits(wall_clock_s=0.5, command_timeout_s=30)
    )
    assert out.exit_reason is ExitReason.WALL_CLOCK and out.tool_timeouts == 0
    assert time.monotonic() - t0 < 4


def test_infrastructure_failures_are_not_scored(provider: LocalProvider) -> None:
    out = episode(provider, scripted([PolicyUnavailableError("connection refused")]), EpisodeLimits())
    assert (out.exit_reason, out.reward, out.infrastructure) == (ExitReason.ENVIRONMENT_ERROR, None, True)

    async def died() -> EpisodeOutcome:
        sandbox = await provider.create(SandboxSpec(limits=FAST))
        await sandbox.close()  # the sandbox is gone before the agent's first command
        return await run_episode(scripted([shell("ls")]), HELLO, sandbox, EpisodeLimits())

    out = asyncio.run(died())
    assert (out.exit_reason, out.reward, out.infrastructure) == (ExitReason.SANDBOX_DIED, None, True)


class FlakyProvider:
    """A real local provider whose first ``failures`` creates fail, as a remote service's might."""

    def __init__(self, inner: LocalProvider, failures: int) -> None:
        self.inner, self.failures, self.attempts = inner, failures, 0

    def describe(self) -> IsolationReport:
        return self.inner.describe()

    async def create(self, spec: SandboxSpec) -> Sandbox:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise SandboxError("the sandbox service is unavailable")
        return await self.inner.create(spec)

    async def aclose(self) -> None:
        pass


def test_sandbox_creation_is_retried_then_reported_as_sandbox_died(
    provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles_envs.terminal import agent

    opts = TerminalAgentOptions(sandbox_retries=2, limits={"wall_s": 5.0})
    flaky = FlakyProvider(provider, failures=2)
    monkeypatch.setattr(agent, "provider_for", lambda _: flaky)
    out = asyncio.run(solve(scripted([shell(SOLVE), say("done")]), HELLO, opts))
    assert (flaky.attempts, out.exit_reason, out.reward) == (3, ExitReason.COMPLETED, 1.0)
    flaky = FlakyProvider(provider, failures=3)
    out = asyncio.run(solve(scripted([shell(SOLVE)]), HELLO, opts))
    assert (flaky.attempts, out.exit_reason, out.reward) == (3, ExitReason.SANDBOX_DIED, None)


def test_a_rows_env_overrides_the_agent_options() -> None:
    opts = episode_options(
        {"max_turns": 8, "command_timeout_s": 30}, {"max_turns": 2, "tool_timeout_budget": 0}
    )
    assert (opts.max_turns, opts.command_timeout_s, opts.tool_timeout_budget) == (2, 30, 0)
    with pytest.raises(ConfigError, match="max_turn"):
        episode_options({}, {"max_turn": 2})
    with pytest.raises(ConfigError, match="mapping"):
        episode_options({}, [("max_turns", 2)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="command_timeout_s"):
        episode_options({"command_timeout_s": -1}, None)


def test_limits_come_from_options_then_the_task() -> None:
    from miles_envs.terminal.agent import limits_of

    assert HELLO.agent_timeout_s == 120
    assert limits_of(HELLO, TerminalAgentOptions(), default_turns=5) == EpisodeLimits(
        max_turns=5, wall_clock_s=120
    )
    opts = TerminalAgentOptions(max_turns=3, wall_clock_s=9)
    assert limits_of(HELLO, opts, default_turns=5).max_turns == 3
    assert limits_of(HELLO, opts, default_turns=5).wall_clock_s == 9


def test_the_agent_cannot_plant_the_tests(provider: LocalProvider) -> None:
    plant = "mkdir -p tests && echo 'exit 0' > tests/test.sh && echo 'exit 0' > run-tests.sh && ln -s /tmp .grader"
    out = episode(provider, scripted([shell(plant), say("done")]), EpisodeLimits())
    assert (out.exit_reason, out.reward) == (ExitReason.COMPLETED, 0.0)
    assert out.test_exit_code not in (0, None)
