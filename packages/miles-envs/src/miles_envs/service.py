"""The agentic side of a run, as a rollout service the core starts without knowing what it is.

``miles_envs.hooks`` contributes it through ``miles_rollout_services`` when the recipe has an
``agentic:`` section: the family, tools and agent are resolved then (before any engine starts,
so a bad name fails early); once the engines are up, ``start`` runs the session server when the
run's generate function declares it needs one (``AgenticNeeds.session_server``) and yields the
resolved settings, which generate functions find in ``RolloutContext.services["agentic"]``.
The checks of what the generate function and the section need from each other are here too
(``check_agentic``, the ``miles_check_config`` hook).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from miles.capabilities import generate_needs
from miles.config.options import OptionSlot, option_slot
from miles.errors import ConfigError
from miles.interfaces import ServiceSetup
from miles.plugins import load_component, make_component
from miles.types import SamplingParams
from miles_envs.context import SECTION, SERVICE, AgenticContext, AgenticNeeds


def agentic_section(config: Any) -> Any:
    """The recipe's ``agentic:`` section (a ``miles_envs.config.AgenticSection``), or None."""
    return getattr(config, SECTION, None)


def agentic_needs(config: Any) -> AgenticNeeds | None:
    """What the run's generate function declares, when it is one of this package's kind."""
    needs = generate_needs(config)
    return needs if isinstance(needs, AgenticNeeds) else None


def uses_server(config: Any) -> bool:
    """Whether the run starts the session server (its generate function says it needs one)."""
    if config.mode != "rl" or agentic_section(config) is None:
        return False
    needs = agentic_needs(config)
    return needs is not None and needs.session_server


def resolve_agentic(config: Any) -> AgenticContext | None:
    """The recipe's agentic settings with every named component loaded; None without ``agentic:``."""
    a = agentic_section(config)
    if a is None:
        return None
    from miles_envs.families import get_family
    from miles_envs.sessions import resolve_matcher

    family = get_family(a.family)
    return AgenticContext(
        family=family,
        session_mode=a.session_mode,
        matcher=resolve_matcher(a.matcher, a.matcher_options),
        leaf_selection=a.leaf_selection,
        toolset=make_component("toolset", a.tools, a.tools_options) if a.tools else None,
        agent=load_component("agent", a.agent) if uses_server(config) else None,
        agent_options=dict(a.agent_options),
        agent_timeout_s=a.agent_timeout_s,
        max_turns=a.max_turns,
        max_seq_len=a.max_seq_len,
        enable_thinking=family.request_thinking(a.chat_template_kwargs),
        chat_template_kwargs=dict(a.chat_template_kwargs),
    )


@dataclasses.dataclass
class AgenticService:
    """The ``agentic`` rollout service: the resolved settings, plus the session server when used."""

    context: AgenticContext
    name: str = SERVICE

    @contextlib.contextmanager
    def start(self, setup: ServiceSetup) -> Iterator[AgenticContext]:
        with session_server(
            setup.config, self.context, setup.engine_urls, setup.tokenizer, setup.sampling, setup.dp_sizes
        ) as context:
            assert context is not None
            yield context


@contextlib.contextmanager
def session_server(
    config: Any,
    agentic: AgenticContext | None,
    engine_urls: list[str],
    tokenizer: object,
    sampling: SamplingParams,
    dp_sizes: list[int] | None = None,
) -> Iterator[AgenticContext | None]:
    """``agentic`` with the run's session server attached, for the duration of the block."""
    if agentic is None or not uses_server(config):
        yield agentic
        return
    from miles.capabilities import engine_client_factory
    from miles.engines.router import Router
    from miles.routing import records_routing
    from miles_envs.session_server.app import ServerState
    from miles_envs.session_server.service import session_service
    from miles_envs.sessions import SessionStore

    a = agentic_section(config)
    assert a is not None  # an AgenticContext is only resolved from an agentic section
    make_client = engine_client_factory(config)  # the engine kind's own client
    clients = [make_client(url) for url in engine_urls]  # opened on the server's own event loop
    state = ServerState(
        store=SessionStore(mode=agentic.session_mode, matcher=agentic.matcher),
        family=agentic.family,
        tokenizer=tokenizer,
        engines=clients,
        sampling=sampling,
        max_seq_len=agentic.max_seq_len,
        router=Router(clients, dp_sizes=dp_sizes),
        chat_template_kwargs=agentic.chat_template_kwargs,
        return_routed_experts=records_routing(config),
    )
    with session_service(state, host=a.server_host, port=a.server_port) as service:
        yield dataclasses.replace(agentic, server=service)


def check_agentic(config: Any) -> None:
    """Refuse a recipe whose generate function and ``agentic:`` section do not fit together."""
    if config.mode != "rl":
        return
    a = agentic_section(config)
    needs = agentic_needs(config)
    fn = repr(config.rollout.generate_fn)
    if needs is not None and needs.model_family and a is None:
        raise ConfigError(
            f"rollout.generate_fn {fn} needs an `agentic:` section naming at least the model family "
            "(agentic.family, e.g. qwen3; docs/model-families.md lists the registered ones)"
        )
    if a is not None and (needs is None or not needs.model_family):
        raise ConfigError(
            f"an `agentic:` section is set but rollout.generate_fn {fn} does not use it; set "
            "rollout.generate_fn to one that runs multi-turn episodes (multi_turn, agentic), or remove the section"
        )
    if needs is None:
        return
    if needs.sync_only_update_modes and config.schedule == "fully_async":
        from miles_envs.sessions.safety import check_update_mode

        check_update_mode(config.fully_async.update_mode)
    if needs.session_server and config.eval is not None and config.eval.mode != "shared":
        raise ConfigError(
            f"eval.mode {config.eval.mode!r} with rollout.generate_fn {fn} is not supported: the agent reaches "
            "engines through the run's session server, which serves the training engines. Use eval.mode: shared"
        )
    if a is not None and a.session_mode == "branching" and not needs.branching:
        raise ConfigError(
            f"agentic.session_mode 'branching' applies to the session server; rollout.generate_fn {fn} "
            "drives a linear conversation itself"
        )


def agentic_option_slots(config: Any) -> list[OptionSlot]:
    """The options mappings of the section's tool set, agent and matcher (those the run uses)."""
    a = agentic_section(config)
    if a is None:
        return []
    found = [
        option_slot("agentic.tools_options", a.tools_options, ("agentic.tools", "toolset", a.tools)),
        # the agent runs only behind the session server
        option_slot("agentic.agent_options", a.agent_options, ("agentic.agent", "agent", a.agent))
        if uses_server(config)
        else None,
        option_slot(
            "agentic.matcher_options", a.matcher_options, ("agentic.matcher", "session_matcher", a.matcher)
        ),
    ]
    return [s for s in found if s is not None]
