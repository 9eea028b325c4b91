"""The Verifiers connector: a ``verifiers`` environment replaces the rollout function.

For each prompt of a step, ``n_samples_per_prompt`` rollouts of the environment run
concurrently, each in its own session of a session server and each with its own
``openai.AsyncOpenAI`` client pointed at that session. The environment's rubric then scores
the group (``Rubric.score_group``, so group reward functions see the whole group). The samples
are what the session server recorded (prompt ids, response ids, loss mask, engine log-probs
and weight versions), never the environment's text tokenized again; each sample's reward is
the rubric's.

The environment is ``rollout.options.env``: an import path (``pkg.module:attr``, an
``Environment`` or a callable returning one, called with ``env_args``) or the id of an
installed verifiers environment (``verifiers.load_environment(env, **env_args)``).

The session server is the run's when the recipe starts one (``rollout.generate_fn: agentic``
with an ``agentic:`` section), otherwise this rollout starts its own on 127.0.0.1 for the
run's engines, with ``rollout.options.family``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from typing import Any

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.interfaces import RolloutContext
from miles.types import ExitReason, Group, Prompt, Sample, Status
from miles_envs.context import agentic_of
from miles_envs.rollout.episodes import episode_samples, prompt_messages

log = logging.getLogger("miles.connectors.verifiers")

_RAISED = "miles_rollout_raised"  # marks the stand-in state of a rollout that raised


class VerifiersOptions(ComponentOptions):
    """``rollout.options`` of the ``verifiers`` rollout."""

    env: str = Field(description="pkg.module:attr (an Environment or a factory) or a verifiers env id")
    env_args: dict[str, Any] = Field(default_factory=dict, description="arguments of the env factory")
    family: str | None = Field(None, description="model family of the rollout's own session server")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="the family's thinking switch, every turn (own server only)"
    )
    max_seq_len: int | None = Field(None, gt=0, description="prompt + response tokens per session")
    model: str = Field("policy", description="the model name the environment's client sends")
    server_host: str = "127.0.0.1"
    request_timeout_s: float = Field(600.0, gt=0)


def load_environment(spec: str, args: dict[str, Any]) -> Any:
    """The verifiers environment ``spec`` names, built with ``args``."""
    import verifiers as vf  # type: ignore[import-untyped]

    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"rollout.options.env {spec!r} cannot be imported: {err}") from err
        env = target(**args) if not isinstance(target, vf.Environment) and callable(target) else target
    else:
        env = vf.load_environment(spec, **args)
    if not isinstance(env, vf.Environment):
        raise ConfigError(
            f"rollout.options.env {spec!r} is not a verifiers Environment: {type(env).__name__}"
        )
    return env


class VerifiersRollout:
    """A rollout function whose trajectories are a verifiers environment's rollouts."""

    Options = VerifiersOptions
    # Its trajectories are session-server sessions, which record every turn's MoE routing when the run
    # asks (its own server gets ctx.return_routed_experts, the run's is configured from the recipe).
    records_routing = True

    def __init__(self, generate_fn: str = "default") -> None:
        del generate_fn  # the environment is the whole rollout: there is no generate layer below
        self._env: Any = None
        self._env_key: tuple[str, str] | None = None
        self._stack = contextlib.ExitStack()
        self._own_server: Any = None

    def close(self) -> None:
        """Stop the rollout's own session server, if it started one."""
        self._stack.close()
        self._own_server = None

    async def __call__(self, ctx: RolloutContext, prompts: list[Prompt]) -> list[Group]:
        opts = VerifiersOptions.model_validate(ctx.options)
        env = self._environment(opts)
        service = self._service(ctx, opts)
        groups = await asyncio.gather(*(self._group(ctx, env, service, opts, p) for p in prompts))
        return list(groups)

    def _environment(self, opts: VerifiersOptions) -> Any:
        key = (opts.env, repr(sorted(opts.env_args.items())))
        if self._env is None or self._env_key != key:
            self._env, self._env_key = load_environment(opts.env, opts.env_args), key
        return self._env

    def _service(self, ctx: RolloutContext, opts: VerifiersOptions) -> Any:
        agentic = agentic_of(ctx)
        if agentic is not None and agentic.server is not None:
            return agentic.server
        if self._own_server is None:
            self._own_server = self._stack.enter_context(_own_session_server(ctx, opts))
        return self._own_server

    async def _group(
        self, ctx: RolloutContext, env: Any, service: Any, opts: VerifiersOptions, prompt: Prompt
    ) -> Group:
        sampling = {
            "temperature": ctx.sampling.temperature,
            "top_p": ctx.sampling.top_p,
            "max_tokens": ctx.sampling.max_new_tokens,
        }
        opened = [service.open() for _ in range(ctx.n_samples_per_prompt)]
        clients = [_client(base_url, opts.request_timeout_s) for _, base_url in opened]

        async def attempt(client: Any) -> Any:
            try:
                return await env.rollout(_rollout_input(env, prompt), client, opts.model, dict(sampling))
            except Exception as exc:  # verifiers keeps its own errors in the state; this is any other
                log.warning("a verifiers rollout raised on prompt %d: %r", prompt.index, exc)
                return {"error": exc, _RAISED: True}

        try:
            states = await asyncio.gather(*(attempt(client) for client in clients))
            scored = await _score(env, [s for s in states if not s.get(_RAISED)])
        finally:
            closed = [service.close(session_id) for session_id, _ in opened]
            await asyncio.gather(*(client.close() for client in clients))
        samples: list[Sample] = []
        for i, (state, done) in enumerate(zip(states, closed, strict=True)):
            slot = Sample(prompt=prompt, group_index=i)
            samples.extend(_samples(state, done, slot, scored, max_turns=getattr(env, "max_turns", -1)))
        for i, sample in enumerate(samples):
            sample.group_index = i
            if ctx.on_sample_done is not None:
                ctx.on_sample_done(sample)
        return Group(prompt=prompt, samples=samples)


def _client(base_url: str, timeout_s: float) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)


def _rollout_input(env: Any, prompt: Prompt) -> dict[str, Any]:
    """A verifiers ``RolloutInput`` for one Miles prompt (the env's system prompt first, if any)."""
    messages = prompt_messages(prompt)
    system = getattr(env, "system_prompt", None)
    if system and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    info = prompt.metadata.get("info", {k: v for k, v in prompt.metadata.items() if k != "env"})
    return {
        "prompt": messages,
        "answer": prompt.label or "",
        "task": prompt.metadata.get("task", getattr(env, "env_id", None) or "default"),
        "example_id": prompt.index,
        "info": info,
    }


async def _score(env: Any, states: list[Any]) -> str | None:
    """Score the group with the env's rubric; the reason it could not, or None."""
    if not states:
        return None
    try:
        await env.rubric.score_group(states)
    except Exception as exc:
        log.warning("the verifiers rubric raised: %s", exc)
        return f"the rubric raised {type(exc).__name__}: {exc}"
    return None


def _samples(
    state: Any, closed: Any, slot: Sample, score_failure: str | None, *, max_turns: int
) -> list[Sample]:
    import verifiers as vf

    error = state.get("error")
    usage = closed.usage
    overlong = isinstance(error, vf.OverlongPromptError) or usage.exhausted
    failure = None
    if error is not None and not overlong:
        failure = f"the verifiers rollout failed: {type(error).__name__}: {error}"
    failure = failure or score_failure
    if overlong or state.get("is_truncated"):
        exit_reason = ExitReason.TOKEN_LIMIT
    elif isinstance(error, vf.InfraError | vf.ModelError):
        exit_reason = ExitReason.ENVIRONMENT_ERROR
    elif failure is not None:
        exit_reason = ExitReason.AGENT_ERROR
    elif state.get("stop_condition") == "max_turns_reached" and max_turns != 1:  # SingleTurnEnv: done
        exit_reason = ExitReason.TURN_LIMIT
    else:
        exit_reason = ExitReason.COMPLETED
    metadata: dict[str, Any] = {
        "turns": len(state.get("trajectory") or []),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "exit_reason": str(exit_reason),
        "verifiers_stop_condition": state.get("stop_condition"),
        "verifiers_metrics": dict(state.get("metrics") or {}),
    }
    samples = episode_samples(
        closed.session,
        slot,
        truncated=overlong or bool(state.get("is_truncated")),
        failure=failure,
        metadata=metadata,
    )
    reward = state.get("reward")
    for sample in samples:
        if exit_reason is ExitReason.ENVIRONMENT_ERROR:
            sample.status, sample.reward = Status.ABORTED, None  # retried, never scored as 0
        elif sample.status is Status.FAILED:
            sample.reward = 0.0
        elif reward is not None:
            sample.reward = float(reward)
    return samples


@contextlib.contextmanager
def _own_session_server(ctx: RolloutContext, opts: VerifiersOptions) -> Any:
    from miles.engines.client import SGLangClient
    from miles_envs.families import get_family
    from miles_envs.session_server.app import ServerState
    from miles_envs.session_server.service import session_service
    from miles_envs.sessions import SessionStore

    if opts.family is None:
        raise ConfigError(
            "rollout.fn 'verifiers' needs rollout.options.family (the model family that renders and "
            "parses the chat), or the run's session server (rollout.generate_fn: agentic)"
        )
    urls = [getattr(e, "url", None) for e in ctx.engines]
    if not urls or any(u is None for u in urls):
        raise ConfigError("rollout.fn 'verifiers' needs engines reachable over HTTP (each client's url)")
    state = ServerState(
        store=SessionStore(mode="linear"),
        family=get_family(opts.family),
        tokenizer=ctx.tokenizer,
        engines=[SGLangClient(str(u)) for u in urls],  # /generate: the embedded engine and SGLang alike
        sampling=ctx.sampling,
        max_seq_len=opts.max_seq_len,
        chat_template_kwargs=opts.chat_template_kwargs,
        return_routed_experts=ctx.return_routed_experts,
    )
    with session_service(state, host=opts.server_host) as service:
        yield service
