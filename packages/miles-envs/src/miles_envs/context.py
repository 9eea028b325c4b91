"""What miles-envs's generate functions declare and what they are handed.

``AgenticNeeds`` extends the core's ``GenerateNeeds`` with what only this package reads (the
core declares no field of its own there); ``AgenticContext`` is the ``agentic:`` section with
every name resolved, as the agentic service hands it to generate functions in
``RolloutContext.services[SERVICE]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from miles.capabilities import GenerateNeeds
from miles.errors import ConfigError

if TYPE_CHECKING:
    from miles.interfaces import RolloutContext
    from miles_envs.interfaces import AgentFn, ToolSet

SECTION = "agentic"  # the recipe section (miles_envs.config.AgenticSection)
SERVICE = "agentic"  # its key in RolloutContext.services


@dataclass(frozen=True)
class AgenticNeeds(GenerateNeeds):
    """What a multi-turn or agentic generate function needs from the run."""

    model_family: bool = False  # an `agentic:` section naming the model family
    session_server: bool = False  # the run's session server (an agent reaches the engines through it)
    sync_only_update_modes: bool = False  # under fully_async, only weight-update modes sessions survive
    branching: bool = False  # it can use agentic.session_mode: branching


@dataclass
class AgenticContext:
    """The multi-turn and agentic generate functions' settings, resolved before the engines start."""

    family: Any  # a miles_envs.families ModelFamily: renders, tokenizes suffixes, parses replies
    session_mode: Literal["linear", "branching"] = "linear"
    matcher: Any = None  # the resolved replay comparison (None: strict)
    # branching sessions: which leaves become samples
    leaf_selection: Literal["drop_retries", "all"] = "drop_retries"
    toolset: ToolSet | None = None
    agent: AgentFn | None = None
    agent_options: dict[str, Any] = field(default_factory=dict)
    agent_timeout_s: float | None = None  # an agent running longer is cancelled; its episode fails
    max_turns: int = 8
    max_seq_len: int | None = None  # prompt + response tokens per trajectory; beyond it: truncated
    # the family's thinking switch for every turn (agentic.chat_template_kwargs; None: the template's default)
    enable_thinking: bool | str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # the recipe's, for the server
    server: Any = None  # the running session server (miles_envs.session_server.SessionService), agentic only


def agentic_of(ctx: RolloutContext) -> AgenticContext | None:
    """The run's resolved agentic settings (None: the recipe has no ``agentic:`` section)."""
    found = ctx.services.get(SERVICE)
    return found if isinstance(found, AgenticContext) else None


def agentic_context(ctx: RolloutContext, generate_fn: str) -> AgenticContext:
    """The run's agentic settings; a clear error when the recipe has no ``agentic:`` section."""
    found = agentic_of(ctx)
    if found is None:
        raise ConfigError(
            f"rollout.generate_fn {generate_fn!r} needs an `agentic:` section in the recipe "
            "(at least agentic.family, the model family that renders and parses the chat)"
        )
    return found
