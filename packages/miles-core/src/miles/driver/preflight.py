"""Everything a run checks before it writes a file or starts a process, in one function.

``miles run`` (``miles.loop.train``) and ``miles config validate --check`` call the same
``preflight``, so validation passes exactly the recipes a run would start: plugins may
refuse the config (``miles_configure``), every component's options are checked against its
options model (``miles.config.options``), the model is resolved, the driver's components
are built (the data source reads and checks its file, the reward and loss are type- and
signature-checked), the components the trainer ranks build are built once here too, and
the engine ports the recipe fixes must be free.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from miles.capabilities import check_needs, check_supervised_kinds
from miles.config.options import check_component_options
from miles.config.schema import MilesConfig
from miles.driver.adapters import check_adapters
from miles.driver.components import Components, build_components
from miles.driver.hooks import Hooks
from miles.driver.routing_replay import check_routing_replay
from miles.errors import ConfigError
from miles.tracking.registry import check_trackers
from miles.tracking.summaries import check_plot_requirements


@dataclass
class Preflight:
    """What the checks produced and the run goes on with."""

    model_path: str  # ``model.path`` resolved (a built-in model is built into the cache)
    components: Components


def preflight(config: MilesConfig, hooks: Hooks | None = None) -> Preflight:
    """Check ``config`` the way a run does before it starts anything; raises a ``MilesError``.

    ``hooks``: the plugin manager's hooks (default: the process's manager).
    """
    from miles.models.registry import resolve_model
    from miles.plugins import get_plugin_manager

    if hooks is None:
        hooks = Hooks(get_plugin_manager())
    # A warm start's supervised stage is checked as fully as the run itself, and first, so that
    # plugins that configure themselves end up configured for this run.
    if config.warm_start is not None:
        from miles.driver.warm_start import warm_start_config

        close_components(preflight(warm_start_config(config, config.run_dir), hooks).components)
    # Plugins see (and may refuse) the config before anything is written or started.
    hooks.miles_configure(config=config)
    # Every component's options against its model, with the file and line of each bad key.
    check_component_options(config)
    check_trackers(config)  # each tracker's library is installed (a one-line install hint if not)
    check_plot_requirements(config)  # tracking.plot: true needs matplotlib, known now rather than at the end
    # Bad models and datasets fail here, before the run directory is touched.
    model_path = resolve_model(config.model.path)
    components = build_components(config, model_path, hooks)
    try:
        if config.mode == "sft":  # the backend trains what the data source yields (tokens, images, ...)
            check_supervised_kinds(config, components.data_source)
        check_needs(config)  # the components fit together (transport, engine kind, generate fn, filters)
        check_adapters(config)  # multi-LoRA: what this slice runs (placement, schedule, backend)
        check_routing_replay(config, model_path)  # MoE routing: model, engine kind, rollout, backend
        if config.mode == "rl":
            from miles.driver.fleet import settings_from

            settings_from(config)  # an explicit engine.max_restarts these engines cannot honour is refused
        check_rank_components(config, components)
        check_engine_ports(config)
    except BaseException:
        close_components(components)
        raise
    return Preflight(model_path, components)


def check_rank_components(config: MilesConfig, components: Components) -> None:
    """Build the components each trainer rank builds for itself, so a bad one fails now, not after
    the engines have started (the ranks build their own copies; these are dropped)."""
    from miles.plugins import make_component

    alg = config.algorithm
    if config.mode == "rl" and alg.correction is not None:
        make_component("correction", alg.correction, alg.correction_options)
    critic = components.objective.critic
    if critic is not None:
        make_component("loss", critic.loss, critic.loss_options)


def check_engine_ports(config: MilesConfig) -> None:
    """The fixed ports (``engine.port`` + i) of engines this run launches must be free now.

    Only for engines launched on this machine: attached engines (``engine.urls``) already
    listen, and Ray places engines on nodes whose ports cannot be probed from here.
    """
    eng = config.engine
    if config.mode != "rl" or eng.urls or eng.port is None or config.placement.launcher != "local":
        return
    from miles.engines.launchers import port_is_free

    for i in range(eng.num_engines):
        port = eng.port + i
        if not port_is_free(eng.host, port):
            raise ConfigError(
                f"engine.port: engine {i} would listen on {eng.host}:{port}, which is already in use; "
                "choose another engine.port or leave it unset to pick free ports"
            )


def close_components(components: Components) -> None:
    """Close what the components hold open (a remote reward's HTTP session); for a check that stops here."""

    async def close() -> None:
        parts = [components, *components.adapters.values()]
        for obj in (x for c in parts for x in (c.reward, *c.reward_postprocess)):
            aclose = getattr(obj, "aclose", None)
            if aclose is not None:
                await aclose()

    asyncio.run(close())
