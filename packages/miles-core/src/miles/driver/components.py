"""Resolve the driver-side components a recipe names (by entry point or import path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.config.schema import MilesConfig
from miles.interfaces import AdvantageEstimator, Buffer, DataSource, GroupFilter, RewardFn, RolloutFn
from miles.plugins import load_component, make_component


@dataclass
class Components:
    data_source: DataSource
    rollout_fn: RolloutFn
    reward: RewardFn
    filters: list[tuple[str, GroupFilter]]
    buffer: Buffer
    advantage: AdvantageEstimator


def build_components(config: MilesConfig) -> Components:
    data_options: dict[str, Any] = config.data.model_dump(exclude={"source"})
    rollout_cls = load_component("rollout", config.rollout.fn)
    # A class takes the generate layer by name; a plain function is the whole rollout itself.
    rollout_fn = (
        rollout_cls(generate_fn=config.rollout.generate_fn) if isinstance(rollout_cls, type) else rollout_cls
    )
    return Components(
        data_source=make_component("data_source", config.data.source, data_options),
        rollout_fn=rollout_fn,
        reward=make_component("reward", config.rollout.reward, config.rollout.reward_options),
        filters=[(name, load_component("filter", name)) for name in config.rollout.filters],
        buffer=make_component("buffer", config.rollout.buffer),
        advantage=make_component("advantage", config.algorithm.advantage, config.algorithm.advantage_options),
    )
