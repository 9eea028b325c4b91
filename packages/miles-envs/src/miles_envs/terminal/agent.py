"""``terminal``: the agent function of terminal tasks (``agentic.agent: terminal``).

Per episode it loads the task named by the prompt's ``metadata["terminal_task"]``, makes a
sandbox with the task's starting files (``agent_options.provider``, default ``local-dir``;
creation is retried ``sandbox_retries`` times), runs the agent loop of
:mod:`miles_envs.terminal.episode` through the session server with the ``openai`` client, runs the
test script, closes the sandbox and reports the reward, the typed exit reason and the tool time.

Settings are ``agentic.agent_options`` (:class:`TerminalAgentOptions`); a dataset row's
``metadata["env"]`` (the task's ``env`` in ``task.yaml``, or a column of a JSONL row named in
``data.metadata_keys``) overrides them for that sample, validated by the same model.
Commands the model writes run only in the sandbox.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from pydantic import Field, ValidationError

from miles.capabilities import ComponentOptions, declare_options
from miles.errors import ComponentError, ConfigError
from miles.types import ExitReason
from miles_envs.interfaces import AgentResult, AgentTask
from miles_envs.sandbox.base import SandboxError, SandboxLimits, SandboxProvider, SandboxSpec
from miles_envs.sandbox.registry import make_provider
from miles_envs.terminal.data import ENV_KEY, TASK_KEY
from miles_envs.terminal.episode import (
    ContextExhaustedError,
    EpisodeLimits,
    EpisodeOutcome,
    Policy,
    PolicyReply,
    PolicyUnavailableError,
    run_episode,
)
from miles_envs.terminal.task import TerminalTask, load_task

log = logging.getLogger("miles.envs.terminal")


class TerminalAgentOptions(ComponentOptions):
    """``agentic.agent_options`` of the ``terminal`` agent (and the keys a row's ``env`` may override)."""

    max_turns: int | None = Field(
        None, ge=1, description="model calls per episode (default agentic.max_turns)"
    )
    max_tokens: int | None = Field(None, ge=1, description="generated tokens per episode (all turns)")
    wall_clock_s: float | None = Field(
        None, gt=0, description="the agent's wall clock (default: the task's max_agent_timeout_sec, else 300)"
    )
    command_timeout_s: float = Field(30.0, gt=0, description="wall clock of one shell command")
    tool_timeout_budget: int = Field(
        2, ge=0, description="command timeouts tolerated before the episode ends"
    )
    sandbox_retries: int = Field(2, ge=0, description="extra attempts at creating the sandbox")
    provider: str = Field("local-dir", description="sandbox provider name or import path")
    provider_options: dict[str, Any] = Field(default_factory=dict, description="the provider's options")
    limits: dict[str, Any] = Field(default_factory=dict, description="SandboxLimits fields (per command)")
    model: str = Field("policy", description="the model name sent to the session server")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds one chat completion may take")


def episode_options(options: Mapping[str, Any], row_env: Mapping[str, Any] | None) -> TerminalAgentOptions:
    """The recipe's agent options with the row's overrides on top, validated together."""
    if row_env is not None and not isinstance(row_env, Mapping):
        raise ConfigError(f"a row's env must be a mapping of agent options, got {type(row_env).__name__}")
    merged = {**options, **(row_env or {})}
    try:
        return TerminalAgentOptions.model_validate(merged)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"terminal agent options (agent_options + the row's env): {problems}") from None


@functools.lru_cache(maxsize=256)
def _task(directory: str) -> TerminalTask:
    return load_task(directory)


def task_from_metadata(metadata: Mapping[str, Any]) -> TerminalTask:
    ref = metadata.get(TASK_KEY)
    if not isinstance(ref, Mapping) or not isinstance(ref.get("dir"), str):
        raise ConfigError(
            f"the terminal agent needs metadata[{TASK_KEY!r}] = {{'dir': TASK_DIR}} on every prompt "
            "(data.source: terminal_tasks sets it)"
        )
    return _task(str(Path(ref["dir"]).resolve()))


_providers: dict[str, SandboxProvider] = {}


def provider_for(opts: TerminalAgentOptions) -> SandboxProvider:
    """One provider per (name, options) for the process: isolation is probed once."""
    key = json.dumps([opts.provider, opts.provider_options], sort_keys=True, default=str)
    if key not in _providers:
        _providers[key] = make_provider(opts.provider, opts.provider_options)
    return _providers[key]


def limits_of(task: TerminalTask, opts: TerminalAgentOptions, default_turns: int) -> EpisodeLimits:
    return EpisodeLimits(
        max_turns=opts.max_turns or default_turns,
        max_tokens=opts.max_tokens,
        wall_clock_s=opts.wall_clock_s or task.agent_timeout_s or 300.0,
        command_timeout_s=opts.command_timeout_s,
        tool_timeout_budget=opts.tool_timeout_budget,
    )


async def solve(
    policy: Policy,
    task: TerminalTask,
    opts: TerminalAgentOptions,
    *,
    default_turns: int = 8,
    messages: list[dict[str, Any]] | None = None,
) -> EpisodeOutcome:
    """One whole episode: sandbox (with retries), agent loop, test script, close."""
    provider = provider_for(opts)
    spec = SandboxSpec(files=dict(task.files), limits=SandboxLimits(**opts.limits))
    sandbox = None
    error: Exception | None = None
    for _ in range(opts.sandbox_retries + 1):
        try:
            sandbox = await provider.create(spec)
            break
        except SandboxError as err:
            error = err
    if sandbox is None:
        return EpisodeOutcome(ExitReason.SANDBOX_DIED, None, detail=f"sandbox creation failed: {error}")
    try:
        return await run_episode(policy, task, sandbox, limits_of(task, opts, default_turns), messages)
    finally:
        try:
            await sandbox.close()
        except SandboxError as err:  # the outcome stands; the provider's aclose cleans up later
            log.warning("closing sandbox %s failed: %s", sandbox.id, err)


def openai_policy(client: Any, model: str, request: Mapping[str, Any]) -> Policy:
    """A :data:`Policy` over an OpenAI-compatible server (the run's session server)."""
    import openai

    async def call(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        try:
            reply = await client.chat.completions.create(
                model=model, messages=messages, tools=tools, **request
            )
        except openai.BadRequestError as exc:
            if _code(exc) == "context_length_exceeded":
                raise ContextExhaustedError(str(exc)) from None
            raise
        except (openai.APIConnectionError, openai.InternalServerError) as exc:
            raise PolicyUnavailableError(f"{type(exc).__name__}: {exc}") from None
        choice = reply.choices[0]
        usage = getattr(reply, "usage", None)
        return PolicyReply(
            message=choice.message.model_dump(exclude_none=True),
            finish_reason=choice.finish_reason,
            completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
        )

    return call


def _code(exc: Any) -> str | None:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return cast("str | None", error.get("type") or error.get("code"))
    return None


@declare_options(TerminalAgentOptions)
async def terminal_agent(task: AgentTask) -> AgentResult:
    try:
        import openai
    except ImportError:
        raise ComponentError(
            "the 'terminal' agent needs the openai package: pip install openai (a dependency of miles-envs)"
        ) from None
    terminal_task = task_from_metadata(task.metadata)
    opts = episode_options(task.options, task.metadata.get(ENV_KEY))
    client = openai.AsyncOpenAI(
        base_url=task.base_url, api_key="unused", max_retries=0, timeout=opts.request_timeout_s
    )
    try:
        policy = openai_policy(client, opts.model, task.request)
        out = await solve(policy, terminal_task, opts, default_turns=task.max_turns, messages=task.messages)
    finally:
        await client.close()
    metadata = {"terminal_task": terminal_task.id, **out.metadata()}
    return AgentResult(
        reward=out.reward,
        metadata=metadata,
        failure=(out.detail or str(out.exit_reason)) if out.infrastructure else None,
        exit_reason=out.exit_reason,
    )
