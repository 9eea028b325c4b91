"""Resolve the driver-side components a recipe names (by entry point or import path)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.config.schema import MilesConfig
from miles.driver.objective import Objective, resolve_objective
from miles.interfaces import (
    Buffer,
    BufferPolicy,
    DataSource,
    GroupFilter,
    RewardFn,
    RewardPostprocessor,
    RolloutFn,
    RolloutService,
)
from miles.plugins import load_component, make_component
from miles.types import Prompt

if TYPE_CHECKING:
    from miles.driver.hooks import Hooks


@dataclass
class Components:
    data_source: DataSource
    rollout_fn: RolloutFn
    reward: RewardFn
    reward_postprocess: list[RewardPostprocessor]
    filters: list[tuple[str, GroupFilter]]
    buffer: Buffer
    objective: Objective
    drops: Any  # miles.driver.generation.DropLog: what the buffer dropped, by reason
    # What plugins run for the rollout (miles_rollout_services), resolved before any engine starts.
    services: list[RolloutService] = field(default_factory=list)
    # Multi-LoRA (lora.adapters): each adapter's own components; data_source then holds them all.
    adapters: dict[str, Components] = field(default_factory=dict)


class SharedDataSource:
    """A data source that the rollout worker, the buffer and the driver may use from different threads."""

    def __init__(self, inner: DataSource) -> None:
        self.inner = inner
        self._lock = threading.Lock()

    def next_prompts(self, n: int) -> list[Prompt]:
        with self._lock:
            return self.inner.next_prompts(n)

    def put_back(self, prompts: Iterable[Prompt]) -> None:
        with self._lock:
            self.inner.put_back(list(prompts))

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.inner.load_state_dict(state)

    def __len__(self) -> int:
        return len(self.inner)


def buffer_policy(config: MilesConfig, filters: list[tuple[str, GroupFilter]]) -> BufferPolicy:
    """The drop rules and capacity the schedule implies (recycle/on_drop are wired by the caller)."""
    if config.schedule == "sync":
        # Staleness cannot occur (every group is generated under the weights it trains against);
        # aborted groups are always retried, as they were before the buffer owned the rules.
        return BufferPolicy(filters=filters)
    fa = config.fully_async
    return BufferPolicy(
        capacity=max(1, math.ceil(fa.buffer_capacity * config.rollout.prompts_per_step)),
        filters=filters,
        max_staleness=fa.max_staleness,
        retry_aborted=fa.aborted == "retry",
        retry_stale=fa.stale == "retry",
    )


def build_components(config: MilesConfig, model_path: str, hooks: Hooks | None = None) -> Components:
    from miles.driver.adapters import AdapterDataSources, adapter_components, adapters_of
    from miles.driver.generation import DropLog
    from miles.driver.rollout_services import resolve_services

    if hooks is None:
        from miles.driver.hooks import Hooks
        from miles.plugins import get_plugin_manager

        hooks = Hooks(get_plugin_manager())
    data_options: dict[str, Any] = config.data.model_dump(exclude={"source"})
    rollout_cls = load_component("rollout", config.rollout.fn)
    # A class takes the generate layer by name; a plain function is the whole rollout itself.
    rollout_fn = (
        rollout_cls(generate_fn=config.rollout.generate_fn) if isinstance(rollout_cls, type) else rollout_cls
    )
    r = config.rollout
    data_source = SharedDataSource(make_component("data_source", config.data.source, data_options))
    filters = [(name, load_component("filter", name)) for name in r.filters]
    drops = DropLog(hooks)
    policy = buffer_policy(config, filters)
    policy.recycle = lambda prompt: data_source.put_back([prompt])
    policy.on_drop = drops.record
    policy.reject = lambda group: hooks.miles_buffer_reject(group=group)
    components = Components(
        data_source=data_source,
        rollout_fn=rollout_fn,
        reward=make_component("reward", r.reward, r.reward_options),
        reward_postprocess=[
            make_component("reward_postprocess", name, r.reward_postprocess_options.get(name, {}))
            for name in r.reward_postprocess
        ],
        filters=filters,
        buffer=make_component("buffer", r.buffer, {"policy": policy}),
        objective=resolve_objective(config, model_path),
        drops=drops,
        services=resolve_services(config, hooks.pm),
    )
    if adapters_of(config):  # multi-LoRA: every adapter draws its own prompts, with its own reward
        components.adapters = adapter_components(config, model_path, hooks)
        components.data_source = AdapterDataSources(
            {n: c.data_source for n, c in components.adapters.items()}
        )
    return components
