"""One terminal-task episode: the agent loop over a sandbox, its limits, and the test script's verdict.

The loop is independent of how the model is reached: a :class:`Policy` answers a conversation
with one reply. :mod:`miles_envs.terminal.agent` gives it the session server (an OpenAI client);
the throughput benchmark gives it a scripted shell agent. The loop ends with a typed
:class:`~miles.types.ExitReason`:

- ``completed``: the model answered without a tool call;
- ``no_response``: it answered nothing at all;
- ``format_error``: a tool call that is not ``shell({"command": str})``;
- ``turn_limit`` / ``token_limit`` / ``wall_clock_timeout``: a limit of :class:`EpisodeLimits`;
- ``tool_error``: more command timeouts than ``tool_timeout_budget`` tolerates;
- ``sandbox_died`` / ``environment_error``: infrastructure (the sandbox, or the model server).

The test script runs after every episode not ended by infrastructure, whatever the exit reason
(a model may have solved the task before it ran out of turns); infrastructure episodes get no
reward at all, so they can be retried instead of scored.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from miles.types import INFRA_EXIT_REASONS, ExitReason
from miles_envs.sandbox.base import ExecReason, Sandbox, SandboxError
from miles_envs.terminal.shell import SHELL_SPEC, FormatError, format_result, parse_call
from miles_envs.terminal.task import TerminalTask


class ContextExhaustedError(Exception):
    """The model server refused the turn: the conversation is out of tokens."""


class PolicyUnavailableError(Exception):
    """The model server could not be reached or failed (an infrastructure failure)."""


@dataclass(frozen=True)
class PolicyReply:
    """One model reply: its chat message (OpenAI form), finish reason and generated tokens."""

    message: dict[str, Any]
    finish_reason: str | None
    completion_tokens: int = 0

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])


#: Answers a conversation (messages, tool specs) with one reply.
Policy = Callable[[list[dict[str, Any]], list[dict[str, Any]]], Awaitable[PolicyReply]]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8  # model calls
    max_tokens: int | None = None  # generated tokens over the whole episode
    wall_clock_s: float = 300.0  # the agent's part of the episode (the test script has its own limit)
    command_timeout_s: float = 30.0  # one shell command
    tool_timeout_budget: int = 2  # command timeouts tolerated; one more ends the episode (tool_error)


@dataclass
class EpisodeOutcome:
    exit_reason: ExitReason
    reward: float | None  # None for infrastructure failures: not scored
    turns: int = 0
    tool_calls: int = 0
    tool_timeouts: int = 0
    tool_time_s: float = 0.0
    completion_tokens: int = 0
    test_exit_code: int | None = None
    detail: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def infrastructure(self) -> bool:
        return self.exit_reason in INFRA_EXIT_REASONS

    def metadata(self) -> dict[str, Any]:
        return {
            "agent_turns": self.turns,
            "agent_tool_calls": self.tool_calls,
            "tool_timeouts": self.tool_timeouts,
            "tool_time_s": self.tool_time_s,
            "test_exit_code": self.test_exit_code,
            **({"exit_detail": self.detail} if self.detail else {}),
        }


async def run_agent_loop(
    policy: Policy,
    task: TerminalTask,
    sandbox: Sandbox,
    limits: EpisodeLimits,
    messages: list[dict[str, Any]] | None = None,
) -> EpisodeOutcome:
    """The agent's part: turns of model reply -> shell commands, until an exit reason.

    ``messages`` is the prompt (default: the task's instruction as one user message)."""
    messages = [dict(m) for m in messages] if messages else [{"role": "user", "content": task.instruction}]
    out = EpisodeOutcome(exit_reason=ExitReason.TURN_LIMIT, reward=None, messages=messages)
    deadline = time.monotonic() + limits.wall_clock_s
    tools = [SHELL_SPEC]

    def end(reason: ExitReason, detail: str = "") -> EpisodeOutcome:
        out.exit_reason, out.detail = reason, detail
        return out

    while out.turns < limits.max_turns:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return end(ExitReason.WALL_CLOCK)
        try:
            reply = await asyncio.wait_for(policy(messages, tools), remaining)
        except TimeoutError:
            return end(ExitReason.WALL_CLOCK, "the model call ran past the episode's wall clock")
        except ContextExhaustedError as err:
            return end(ExitReason.TOKEN_LIMIT, str(err))
        except PolicyUnavailableError as err:
            return end(ExitReason.ENVIRONMENT_ERROR, str(err))
        out.turns += 1
        out.completion_tokens += reply.completion_tokens
        messages.append(reply.message)
        calls = reply.tool_calls
        if not calls:
            if reply.finish_reason == "length":
                return end(ExitReason.TOKEN_LIMIT, "the reply hit max_tokens")
            if not str(reply.message.get("content") or "").strip():
                return end(ExitReason.NO_RESPONSE)
            return end(ExitReason.COMPLETED)
        for call in calls:
            try:
                shell = parse_call(call)
            except FormatError as err:
                return end(ExitReason.FORMAT_ERROR, str(err))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return end(ExitReason.WALL_CLOCK)
            timeout = min(limits.command_timeout_s, remaining)
            t0 = time.perf_counter()
            try:
                result = await sandbox.exec(shell.command, timeout_s=timeout)
            except SandboxError as err:
                return end(ExitReason.SANDBOX_DIED, f"exec failed: {err}")
            finally:
                out.tool_time_s += time.perf_counter() - t0
            out.tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": shell.call_id, "content": format_result(result)})
            if result.reason is ExecReason.TIMEOUT:
                if timeout < limits.command_timeout_s:  # cut short by the episode's own clock
                    return end(ExitReason.WALL_CLOCK)
                out.tool_timeouts += 1
                if out.tool_timeouts > limits.tool_timeout_budget:
                    return end(
                        ExitReason.TOOL_ERROR,
                        f"{out.tool_timeouts} command timeouts (budget {limits.tool_timeout_budget})",
                    )
        if limits.max_tokens is not None and out.completion_tokens >= limits.max_tokens:
            return end(ExitReason.TOKEN_LIMIT, f"{out.completion_tokens} tokens generated")
    return end(ExitReason.TURN_LIMIT)


async def grade(task: TerminalTask, sandbox: Sandbox, out: EpisodeOutcome) -> EpisodeOutcome:
    """Run the task's test script in the sandbox: exit 0 is reward 1, anything else 0.

    The tests are written only now, into a directory named at random (``TEST_DIR``), so the agent
    never saw them and nothing it left in the sandbox can take their place. An infrastructure
    outcome is left unscored.
    """
    if out.infrastructure:
        return out
    test_dir = f".grader-{secrets.token_hex(8)}"
    try:
        health = await sandbox.health()
        if not health.alive:
            out.exit_reason, out.detail = ExitReason.SANDBOX_DIED, f"sandbox unhealthy: {health.detail}"
            return out
        for path, content in task.tests.items():
            await sandbox.write_file(f"{test_dir}/{path}", content)
        command = f"TEST_DIR={test_dir} sh {test_dir}/{task.test_script}"
        result = await sandbox.exec(command, timeout_s=task.test_timeout_s)
    except SandboxError as err:
        out.exit_reason, out.detail = ExitReason.SANDBOX_DIED, f"grading failed: {err}"
        return out
    out.test_exit_code = result.exit_code
    out.reward = 1.0 if result.ok else 0.0
    return out


async def run_episode(
    policy: Policy,
    task: TerminalTask,
    sandbox: Sandbox,
    limits: EpisodeLimits,
    messages: list[dict[str, Any]] | None = None,
) -> EpisodeOutcome:
    """The agent loop, then the test script."""
    return await grade(task, sandbox, await run_agent_loop(policy, task, sandbox, limits, messages))
