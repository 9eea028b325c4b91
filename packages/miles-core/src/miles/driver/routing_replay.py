"""The pre-flight check of MoE routing recording and replay (R3), before anything starts.

A run records routing with ``rollout.record_routed_experts`` or ``train.use_rollout_routing_replay``
(:func:`miles.routing.records_routing`). Each component involved says what it can do, and a run
that asks what one cannot is refused in one line naming it:

- the model has routed experts (a dense model has nothing to record or replay);
- the engine kind returns routing (``EngineCapabilities.routing_capture``);
- the rollout records it: a rollout function, or a rollout class that says so itself
  (``records_routing = True``: one that is the whole rollout), declares ``records_routing``
  (``miles.capabilities.declare_records_routing``); any other rollout class runs the generate
  function it is given, which must declare it;
- replay only: the backend replays, i.e. its class has ``routing_replay_problem(model_path, config)``
  and that finds nothing wrong with this model and recipe (one sentence when it does).

A rollout that declares it but hands the trainer a sample without full routing is refused by the
backend when it meets it (``miles.routing.replay_problem``).
"""

from __future__ import annotations

from typing import NoReturn

from miles.capabilities import declares_records_routing, engine_capabilities
from miles.config.schema import MilesConfig
from miles.errors import ConfigError
from miles.routing import records_routing


def check_routing_replay(config: MilesConfig, model_path: str) -> None:
    """Refuse a recipe that records or replays MoE routing where a component cannot (see the module)."""
    if not records_routing(config):
        return
    from miles.models.registry import routed_expert_count
    from miles.plugins import load_component

    replay = config.train.use_rollout_routing_replay
    what = "train.use_rollout_routing_replay" if replay else "rollout.record_routed_experts"

    def refuse(why: str) -> NoReturn:
        raise ConfigError(f"{what}: {why}")

    if routed_expert_count(model_path) == 0:
        refuse(
            f"model {config.model.path!r} is dense (its config.json names no routed experts): there is no "
            "MoE routing to record or replay; turn it off"
        )
    caps = engine_capabilities(load_component("engine", config.engine.launcher))
    if caps.routing_capture is None:
        refuse(
            f"engine.launcher {config.engine.launcher!r} does not return MoE routing (its capabilities "
            "declare no routing_capture); choose an engine kind that does"
        )
    rollout = load_component("rollout", config.rollout.fn)
    if isinstance(rollout, type) and not declares_records_routing(rollout):
        # A rollout class runs the generate function it is given.
        if not declares_records_routing(load_component("generate", config.rollout.generate_fn)):
            refuse(
                f"rollout.generate_fn {config.rollout.generate_fn!r} does not record MoE routing (it does not "
                "declare records_routing, miles.capabilities.declare_records_routing); use one that does"
            )
    elif not declares_records_routing(rollout):
        refuse(
            f"rollout.fn {config.rollout.fn!r} does not record MoE routing (it does not declare "
            "records_routing, miles.capabilities.declare_records_routing); use one that does"
        )
    if not replay:
        return
    backend = load_component("backend", config.backend)
    check = getattr(backend, "routing_replay_problem", None)
    if not callable(check):
        refuse(
            f"backend {config.backend!r} cannot replay routing (its class has no routing_replay_problem); "
            "use a backend that can, or record only (rollout.record_routed_experts)"
        )
    problem = check(model_path, config)
    if problem:
        refuse(f"backend {config.backend!r}: {problem}")
