"""The services a run's rollout uses, contributed by plugins (``miles_rollout_services``).

The core does not know what they are (a server that agents talk to, say): it asks
the plugins for them while the components are resolved, before any engine starts, so a bad
setting fails early; it starts each once the engines are up and hands what each yields to
generate functions as ``RolloutContext.services[name]``; it closes them when the run ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from miles.config.schema import MilesConfig
from miles.errors import ComponentError
from miles.interfaces import EngineClient, RolloutService, ServiceSetup
from miles.types import SamplingParams


def resolve_services(config: MilesConfig, pm: Any) -> list[RolloutService]:
    """The rollout services the plugins of ``pm`` contribute for ``config`` (none outside RL)."""
    if config.mode != "rl":
        return []
    services: list[RolloutService] = []
    for result in pm.hook.miles_rollout_services(config=config):
        items = [result] if isinstance(result, RolloutService) else list(result or ())
        for service in items:
            if not isinstance(service, RolloutService):
                raise ComponentError(
                    f"miles_rollout_services returned {service!r}; expected RolloutService objects "
                    "(a name and a start(setup) context manager)"
                )
            services.append(service)
    names = [s.name for s in services]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ComponentError(
            f"two rollout services are named {', '.join(map(repr, twice))}; names must be unique"
        )
    return services


@contextlib.contextmanager
def started_services(
    services: list[RolloutService],
    config: MilesConfig,
    engine_urls: list[str],
    tokenizer: object,
    sampling: SamplingParams,
    dp_sizes: list[int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Every service started (in order, closed in reverse): ``{name: what its start yielded}``."""
    setup = ServiceSetup(
        config=config,
        engine_urls=list(engine_urls),
        tokenizer=tokenizer,
        sampling=sampling,
        dp_sizes=dp_sizes,
    )
    with contextlib.ExitStack() as stack:
        yield {service.name: stack.enter_context(service.start(setup)) for service in services}


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
