"""The OpenEnv connector: an agent function that plays an OpenEnv environment through the session server.

One episode: a fresh environment (``agent_options.env``, an import path of an
``openenv.core.env_server.Environment`` subclass or factory, built with ``env_kwargs``) is reset;
the observation's text joins the prompt as a user message; then, each turn, the model's reply
(through the session server, with the ``openai`` client) becomes the environment's action
(``action``: the Action class, its text field ``action_field``), ``step`` answers with the next
observation and a reward, until the observation says ``done`` or the turns run out. The
episode's reward is the sum of the step rewards (or the last one: ``reward: last``); read it with
``rollout.reward: agent``.

The environment runs in this process (its ``reset_async`` / ``step_async``). OpenEnv's Docker and
Hugging Face Space environments (``EnvClient`` over a WebSocket to a container) are not driven
here: they need a container runtime.
"""

from __future__ import annotations

import importlib
import json
import time
from typing import Any, Literal

from pydantic import Field, ValidationError

from miles.capabilities import ComponentOptions, declare_options
from miles.errors import ConfigError
from miles.types import ExitReason
from miles_envs.interfaces import AgentResult, AgentTask

_OBSERVATION_BASE = {"done", "reward", "metadata"}


class OpenEnvOptions(ComponentOptions):
    """``agentic.agent_options`` of the ``openenv`` agent."""

    env: str = Field(description="pkg.module:attr, an OpenEnv Environment class or factory")
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    action: str = Field(description="pkg.module:attr, the environment's Action class")
    action_field: str | None = Field(
        None, description="the Action field the reply text goes in (default: its one str field)"
    )
    observation_field: str | None = Field(
        None, description="the Observation field shown to the model (default: all its own fields, as JSON)"
    )
    reward: Literal["sum", "last"] = "sum"
    max_turns: int | None = Field(None, gt=0, description="default: agentic.max_turns")
    model: str = "policy"
    request_timeout_s: float = Field(600.0, gt=0)


def _import(spec: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise ConfigError(f"agentic.agent_options.{what} {spec!r} must be an import path pkg.module:attr")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"agentic.agent_options.{what} {spec!r} cannot be imported: {err}") from err


def _text_field(action_cls: Any, chosen: str | None) -> str:
    fields = action_cls.model_fields
    if chosen is not None:
        if chosen not in fields:
            raise ConfigError(
                f"the Action {action_cls.__name__} has no field {chosen!r}; it has {sorted(fields)}"
            )
        return chosen
    texts = [name for name, f in fields.items() if name != "metadata" and f.annotation is str]
    if len(texts) != 1:
        raise ConfigError(
            f"the Action {action_cls.__name__} has {len(texts)} str fields ({texts}): name one in action_field"
        )
    return texts[0]


def observation_text(observation: Any, field: str | None) -> str:
    """What the model reads of an observation: one field, or its own fields as JSON."""
    if field is not None:
        return str(getattr(observation, field))
    own = observation.model_dump(exclude=_OBSERVATION_BASE)
    if len(own) == 1:
        [value] = own.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(own, default=str)


@declare_options(OpenEnvOptions)
async def openenv_agent(task: AgentTask) -> AgentResult:
    """Play one OpenEnv episode with the policy; the environment's reward is the episode's."""
    import openai
    from openenv.core.env_server import Environment  # type: ignore[import-untyped]

    opts = OpenEnvOptions.model_validate(task.options)
    action_cls = _import(opts.action, "action")
    field = _text_field(action_cls, opts.action_field)
    make_env = _import(opts.env, "env")
    env = make_env(**opts.env_kwargs)
    if not isinstance(env, Environment):
        raise ConfigError(f"agentic.agent_options.env {opts.env!r} did not build an OpenEnv Environment")
    client = openai.AsyncOpenAI(
        base_url=task.base_url, api_key="unused", max_retries=0, timeout=opts.request_timeout_s
    )
    messages: list[Any] = list(task.messages)
    rewards: list[float] = []
    turns, env_time = 0, 0.0
    exit_reason = ExitReason.TURN_LIMIT
    failure: str | None = None
    try:
        t0 = time.perf_counter()
        try:
            observation = await env.reset_async()
        except Exception as exc:
            return _env_failed(exc, 0, rewards, env_time)
        env_time += time.perf_counter() - t0
        shown = observation_text(observation, opts.observation_field)
        if shown:
            messages.append({"role": "user", "content": shown})
        for _ in range(opts.max_turns or task.max_turns):
            try:
                reply = await client.chat.completions.create(
                    model=opts.model, messages=messages, **task.request
                )
            except openai.BadRequestError as err:
                if "context_length_exceeded" in str(err):
                    exit_reason = ExitReason.TOKEN_LIMIT
                    break
                raise
            except (openai.APIConnectionError, openai.InternalServerError) as err:
                exit_reason, failure = ExitReason.ENVIRONMENT_ERROR, f"the model server failed: {err}"
                break
            turns += 1
            choice = reply.choices[0]
            text = choice.message.content or ""
            messages.append({"role": "assistant", "content": text})
            if not text:
                exit_reason = ExitReason.NO_RESPONSE
                break
            try:
                action = action_cls(**{field: text})
            except ValidationError as err:
                exit_reason, failure = ExitReason.FORMAT_ERROR, None
                messages.append({"role": "user", "content": f"invalid action: {err.errors()[0]['msg']}"})
                break
            t0 = time.perf_counter()
            try:
                observation = await env.step_async(action)
            except Exception as exc:
                return _env_failed(exc, turns, rewards, env_time)
            env_time += time.perf_counter() - t0
            if observation.reward is not None:
                rewards.append(float(observation.reward))
            if observation.done:
                exit_reason = ExitReason.COMPLETED
                break
            if choice.finish_reason == "length":
                exit_reason = ExitReason.TOKEN_LIMIT
                break
            messages.append(
                {"role": "user", "content": observation_text(observation, opts.observation_field)}
            )
    finally:
        await client.close()
        env.close()
    reward = (rewards[-1] if opts.reward == "last" else sum(rewards)) if rewards else 0.0
    metadata = {"turns": turns, "env_steps": len(rewards), "tool_time_s": env_time}
    return AgentResult(reward=reward, metadata=metadata, failure=failure, exit_reason=exit_reason)


def _env_failed(exc: Exception, turns: int, rewards: list[float], env_time: float) -> AgentResult:
    """The environment itself raised: infrastructure, never scored (the episode is retried)."""
    return AgentResult(
        reward=None,
        metadata={"turns": turns, "env_steps": len(rewards), "tool_time_s": env_time},
        failure=f"the OpenEnv environment raised {type(exc).__name__}: {exc}",
        exit_reason=ExitReason.ENVIRONMENT_ERROR,
    )
