"""The agentic side of a run: the family, tools and agent resolved from ``agentic:`` (before any
engine starts, so a bad name fails early), and the session server started for the run."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

from miles.config.schema import MilesConfig
from miles.interfaces import AgenticContext, EngineClient
from miles.plugins import load_component, make_component
from miles.types import SamplingParams


def resolve_agentic(config: MilesConfig) -> AgenticContext | None:
    """The recipe's agentic settings with every named component loaded; None without ``agentic:``."""
    a = config.agentic
    if a is None:
        return None
    from miles.families import get_family
    from miles.sessions import resolve_matcher

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


def uses_server(config: MilesConfig) -> bool:
    """The session server runs when the generate function declares it needs one (``GenerateNeeds``)."""
    from miles.capabilities import uses_session_server

    return uses_session_server(config)


def fleet_dp_sizes(engine_urls: list[str], config: MilesConfig | None = None) -> list[int]:
    """Each engine's data-parallel ranks (``dp_size`` of ``/get_server_info``), so that session
    routing can pin a session to one rank of an engine that has several (SGLang with DP attention).

    The engines are asked through ``config``'s engine kind's client; without ``config``, through
    the client of SGLang's native API, which both built-in kinds serve."""
    import asyncio

    from miles.engines.router import engine_dp_sizes

    make_client = _client_factory(config)

    async def ask() -> list[int]:
        clients = [make_client(url) for url in engine_urls]
        try:
            return await engine_dp_sizes(clients)
        finally:
            for client in clients:
                close = getattr(client, "aclose", None)
                if close is not None:
                    await close()

    return asyncio.run(ask())


def _client_factory(config: MilesConfig | None) -> Callable[[str], EngineClient]:
    if config is not None:
        from miles.capabilities import engine_client_factory

        return engine_client_factory(config)
    from miles.engines.client import SGLangClient

    return SGLangClient


@contextlib.contextmanager
def session_server(
    config: MilesConfig,
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
    from miles.session_server.app import ServerState
    from miles.session_server.service import session_service
    from miles.sessions import SessionStore

    a = config.agentic
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
    )
    with session_service(state, host=a.server_host, port=a.server_port) as service:
        yield dataclasses.replace(agentic, server=service)
