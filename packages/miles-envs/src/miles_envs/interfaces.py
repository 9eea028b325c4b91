"""The contracts of the agentic layer: tool sets, the task an agent function gets, what it reports.

These are miles-envs' own kinds of component (declared in ``miles_envs.kinds``): the core's loop
never calls an agent or a tool set; the agentic generate function here does. A third-party agent
or tool set implements these, exactly as the built-ins do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from miles.types import ExitReason


@runtime_checkable
class ToolSet(Protocol):
    """Tools a multi-turn episode may call: their OpenAI specs and how to run one call.

    ``call`` gets the parsed JSON arguments and returns the tool message's content. It raises
    ``ToolError`` for a call the model got wrong (unknown tool, bad arguments): the episode goes
    on and the model sees the error text, as it would from a real tool. Anything else it
    raises fails the trajectory.
    """

    def specs(self) -> list[dict[str, Any]]: ...

    def call(self, name: str, arguments: dict[str, Any]) -> Awaitable[str]: ...


@dataclass
class AgentTask:
    """What an agent function gets for one episode.

    ``base_url`` ends in ``/v1``: give it to any OpenAI-compatible client as its base URL. The
    server decides the tokens, so the agent may send whatever messages it likes; only what it
    sends through ``base_url`` is trained on.
    """

    base_url: str
    messages: list[dict[str, Any]]  # the prompt as chat messages (a text prompt is one user message)
    tools: list[dict[str, Any]] | None  # OpenAI tool specs of the run's tool set, if it has one
    request: dict[str, Any]  # chat-completion defaults from the recipe: temperature, top_p, max_tokens
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # the prompt's metadata
    toolset: ToolSet | None = None  # runs the tools the model calls (agents may bring their own)
    max_turns: int = 8  # model calls the agent should stop after (the recipe sets it)
    options: dict[str, Any] = field(default_factory=dict)  # the agent's options from the recipe


@dataclass
class AgentResult:
    """What an agent function may report; every field is optional.

    ``reward``, when set, is the trajectory's reward (the ``agent`` reward reads it).
    ``metadata`` is merged into each sample's metadata. ``failure`` marks the episode failed
    (it is not rewarded and counts as reward 0 in its group, as a sample whose reward raised does).
    """

    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None
    # Why the episode ended (kept as ``metadata["exit_reason"]``); an infrastructure reason
    # (``INFRA_EXIT_REASONS``) marks the episode ABORTED: dropped and retried, never rewarded.
    exit_reason: ExitReason | None = None


# An agent function runs one episode against the session server (the innermost layer).
AgentFn = Callable[[AgentTask], "Awaitable[AgentResult | dict[str, Any] | None]"]
