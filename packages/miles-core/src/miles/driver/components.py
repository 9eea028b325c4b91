"""Resolve the driver-side components a recipe names (by entry point or import path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.config.schema import MilesConfig
from miles.driver.objective import Objective, resolve_objective
from miles.interfaces import Buffer, DataSource, GroupFilter, RewardFn, RewardPostprocessor, RolloutFn
from miles.plugins import load_component, make_component


@dataclass
class Components:
    data_source: DataSource
    rollout_fn: RolloutFn
    reward: RewardFn
    reward_postprocess: list[RewardPostprocessor]
    filters: list[tuple[str, GroupFilter]]
    buffer: Buffer
    objective: Objective


def build_components(config: MilesConfig, model_path: str) -> Components:
    data_options: dict[str, Any] = config.data.model_dump(exclude={"source"})
    rollout_cls = load_component("rollout", config.rollout.fn)
    # A class takes the generate layer by name; a plain function is the whole rollout itself.
    rollout_fn = (
        rollout_cls(generate_fn=config.rollout.generate_fn) if isinstance(rollout_cls, type) else rollout_cls
    )
    r = config.rollout
    return Components(
        data_source=make_component("data_source", config.data.source, data_options),
        rollout_fn=rollout_fn,
        reward=make_component("reward", r.reward, r.reward_options),
        reward_postprocess=[
            make_component("reward_postprocess", name, r.reward_postprocess_options.get(name, {}))
            for name in r.reward_postprocess
        ],
        filters=[(name, load_component("filter", name)) for name in r.filters],
        buffer=make_component("buffer", r.buffer),
        objective=resolve_objective(config, model_path),
    )
