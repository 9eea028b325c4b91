"""Multi-LoRA recipes this slice does not run are refused in one line, before anything starts."""

from __future__ import annotations

import json

import pytest

ADAPTERS = {"math": {"rank": 4}, "code": {"rank": 2, "lr": 0.02, "num_steps": 3}}


class PlainBackend:
    """A backend class that does not say it trains several adapters."""


def _config(tiny_base, *overrides: str, adapters: dict | None = None):
    from miles.config import load_recipe

    lora = {"adapters": ADAPTERS if adapters is None else adapters}
    return load_recipe(
        "default",
        [f"model.path={tiny_base}", f"lora={json.dumps(lora)}", "warm_start=null", "eval=null", *overrides],
    )


def test_a_runnable_multi_lora_recipe_passes(tiny_base):
    from miles.driver.adapters import adapter_config, adapter_steps, check_adapters

    config = _config(tiny_base, "run.num_steps=5")
    check_adapters(config)
    assert adapter_steps(config) == {"math": 5, "code": 3}
    assert adapter_config(config, "code").lora is None
    assert list(config.lora.named()) == ["math", "code"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["transport=colocated"], "disaggregated placement only"),
        (["placement.mode=colocated", "transport=colocated"], "disaggregated placement only"),
        (["schedule=fully_async"], "schedule: sync only"),
        (["weight_sync.check_equal=true"], "check_equal"),
        (["backend=lora.test_multi_lora_refusals:PlainBackend"], "cannot train several adapters"),
    ],
)
def test_what_is_not_built_is_refused(tiny_base, overrides, message):
    from miles.driver.adapters import check_adapters
    from miles.errors import ConfigError

    config = _config(tiny_base, *overrides)
    with pytest.raises(ConfigError, match=message):
        check_adapters(config)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"rank": 4, "adapters": ADAPTERS}, r"lora\.rank has no effect"),
        ({"adapters": {}}, "lora.adapters is empty"),
        ({"adapters": {"a": {}}}, "part of 'lora_'"),
        ({"adapters": {"x.y": {}}}, "no dots"),
        ({"adapters": {"math": {"rank": 0}}}, r"lora\.rank must be > 0"),
    ],
)
def test_bad_adapter_sections_are_refused(tiny_base, lora, message):
    from miles.config import load_recipe
    from miles.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_recipe("default", [f"model.path={tiny_base}", f"lora={json.dumps(lora)}"])


def test_an_adapter_s_unknown_targets_name_the_adapter(tiny_base):
    from miles.config.schema import LoraShape
    from miles.errors import ConfigError
    from miles_fsdp.lora import check_targets

    with pytest.raises(ConfigError, match=r"lora\.adapters\.code\.target_modules \['qkv'\]"):
        check_targets(str(tiny_base), LoraShape(target_modules=["qkv"]), "lora.adapters.code.target_modules")


def test_each_adapter_draws_its_own_prompts_and_they_resume(tiny_base):
    from miles.driver.components import build_components

    config = _config(tiny_base, "run.num_steps=5")
    first = build_components(config, str(tiny_base))
    assert list(first.adapters) == ["math", "code"]
    math = first.adapters["math"].data_source
    math.next_prompts(3)
    state = first.data_source.state_dict()
    assert sorted(state["adapters"]) == ["code", "math"]
    want = [p.index for p in math.next_prompts(2)]
    again = build_components(config, str(tiny_base))
    again.data_source.load_state_dict(state)
    assert [p.index for p in again.adapters["math"].data_source.next_prompts(2)] == want
