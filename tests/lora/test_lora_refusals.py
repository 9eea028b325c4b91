"""LoRA runs that cannot work are refused before anything heavy starts."""

from __future__ import annotations

import pytest


def _config(tiny_base, *overrides: str):
    from miles.config import load_recipe

    return load_recipe("default", [f"model.path={tiny_base}", "lora.rank=4", *overrides])


def test_rank_must_be_positive(tiny_base):
    from miles.errors import ConfigError

    with pytest.raises(ConfigError, match=r"lora\.rank must be > 0"):
        _config(tiny_base, "lora.rank=0")


def test_unknown_target_modules_list_the_model_linears(tiny_base):
    from miles.config.schema import LoraSection
    from miles.errors import ConfigError
    from miles_fsdp.lora import check_targets

    with pytest.raises(ConfigError, match=r"\['qkv'\] match no linear module.*'q_proj'"):
        check_targets(str(tiny_base), LoraSection(target_modules=["q_proj", "qkv"]))
    covered = check_targets(str(tiny_base), LoraSection(target_modules=["mlp.down_proj"]))
    assert covered == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


@pytest.mark.parametrize("transport", ["p2p", "disk-delta"])
def test_transports_that_cannot_carry_an_adapter_are_refused(tiny_base, transport):
    from miles.errors import ConfigError
    from miles_fsdp.hooks import miles_configure

    with pytest.raises(ConfigError, match=f"transport '{transport}' cannot carry a LoRA adapter"):
        miles_configure(_config(tiny_base, f"transport={transport}"))


@pytest.mark.parametrize("transport", ["broadcast", "colocated"])
def test_broadcast_and_colocated_carry_adapters(tiny_base, transport):
    from miles_fsdp.hooks import miles_configure

    miles_configure(_config(tiny_base, f"transport={transport}"))
