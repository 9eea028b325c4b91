"""The contract through which a plugin's rollout stack joins a run without the core naming it.

A plugin (here a test plugin, no agentic code involved) refuses recipes in
``miles_check_config``, has its section's component options validated through
``miles_option_slots``, and contributes a ``RolloutService`` through ``miles_rollout_services``
that the driver starts with the engines and hands to generate functions as
``RolloutContext.services[name]``. miles-envs registers its session server the same way
(``tests/agentic/test_agentic_runs.py`` runs it end to end).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import Field

from miles import hookimpl
from miles.capabilities import ComponentOptions, declare_options
from miles.interfaces import RolloutService, ServiceSetup
from miles.plugins import get_plugin_manager, reset_plugin_state
from miles.types import SamplingParams


class _ScaleOptions(ComponentOptions):
    scale: float = Field(1.0, gt=0)


@declare_options(_ScaleOptions)
class ScaledReward:
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, sample: Any) -> float:
        return self.scale


class _Service:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    @contextlib.contextmanager
    def start(self, setup: ServiceSetup) -> Iterator[dict[str, Any]]:
        self.log.append(f"start {self.name}")
        try:
            yield {"urls": setup.engine_urls, "dp": setup.dp_sizes, "temperature": setup.sampling.temperature}
        finally:
            self.log.append(f"stop {self.name}")


class ServicePlugin:
    def __init__(
        self, *, refuse: str | None = None, options: dict[str, Any] | None = None, names=("svc",)
    ) -> None:
        self.refuse = refuse
        self.options = options
        self.names = names
        self.log: list[str] = []

    @hookimpl
    def miles_check_config(self, config: Any) -> None:
        from miles.errors import ConfigError

        if self.refuse is not None:
            raise ConfigError(self.refuse)

    @hookimpl
    def miles_option_slots(self, config: Any) -> list[Any]:
        from miles.config.options import option_slot

        if self.options is None:
            return []
        slot = option_slot(
            "rollout.reward_options",
            self.options,
            ("rollout.reward", "reward", "test_plugin_services:ScaledReward"),
        )
        return [slot] if slot is not None else []

    @hookimpl
    def miles_rollout_services(self, config: Any) -> list[RolloutService]:
        return [_Service(name, self.log) for name in self.names]


@pytest.fixture
def registered():
    reset_plugin_state()
    pm = get_plugin_manager()
    plugins: list[Any] = []

    def register(plugin: Any) -> Any:
        pm.register(plugin)
        plugins.append(plugin)
        return plugin

    yield register
    for plugin in plugins:
        pm.unregister(plugin)
    reset_plugin_state()


def test_check_config_may_refuse_a_recipe(registered) -> None:
    from miles.capabilities import check_needs
    from miles.config import load_recipe
    from miles.errors import ConfigError

    config = load_recipe("default")
    check_needs(config)  # nothing to refuse yet
    registered(ServicePlugin(refuse="the test plugin refuses this recipe"))
    with pytest.raises(ConfigError, match="the test plugin refuses this recipe"):
        check_needs(config)


def test_option_slots_of_a_plugin_are_validated_like_the_cores(registered) -> None:
    from miles.config import load_recipe
    from miles.config.loader import RecipeError
    from miles.config.options import check_component_options, option_slots

    config = load_recipe("default")
    registered(ServicePlugin(options={"scale": 2.0}))
    assert ("rollout", "reward_options") in [s.path for s in option_slots(config)]
    check_component_options(config)
    registered(ServicePlugin(options={"scale": -1.0, "sclae": 1}))
    with pytest.raises(RecipeError) as err:
        check_component_options(config)
    assert "sclae" in str(err.value) and "scale" in str(err.value)


def test_rollout_services_start_in_order_and_reach_the_rollout_context(registered) -> None:
    from miles.config import load_recipe
    from miles.driver.rollout_services import resolve_services, started_services

    plugin = registered(ServicePlugin(names=("first", "second")))
    config = load_recipe("default")
    services = resolve_services(config, get_plugin_manager())
    assert [s.name for s in services] == ["first", "second"] and plugin.log == []
    sampling = SamplingParams(temperature=0.5)
    with started_services(services, config, ["http://e0"], object(), sampling, [2]) as provided:
        assert plugin.log == ["start first", "start second"]
        assert provided["first"] == {"urls": ["http://e0"], "dp": [2], "temperature": 0.5}
    assert plugin.log[2:] == ["stop second", "stop first"]
    sft = load_recipe("sft-arith")
    assert resolve_services(sft, get_plugin_manager()) == []  # no rollout, no rollout services


def test_two_services_with_one_name_are_refused(registered) -> None:
    from miles.config import load_recipe
    from miles.driver.rollout_services import resolve_services
    from miles.errors import ComponentError

    registered(ServicePlugin(names=("svc", "svc")))
    with pytest.raises(ComponentError, match="two rollout services are named 'svc'"):
        resolve_services(load_recipe("default"), get_plugin_manager())
