"""LoRA recipes the Megatron backend cannot run are refused in one sentence, before anything starts;
the ones it runs pass the pre-flight (``miles config validate --check``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from megatron_helpers import SHAPE

from miles.config.schema import LoraSection
from miles.errors import ConfigError
from miles_megatron.config import MegatronOptions
from miles_megatron.hf_config import HFModel
from miles_megatron.lora import adapter_of, option_problems, plan, plans

RAW = dict(SHAPE, model_type="qwen3", rope_theta=10000.0)
QWEN3 = HFModel.from_dict(RAW)


def _validate(*sets: str) -> tuple[int, list[str]]:
    from miles.cli import cli

    base = ["backend=megatron", "megatron.device=cpu", "warm_start=null", "eval=null"]
    result = CliRunner().invoke(
        cli, ["config", "validate", "--check"] + [a for s in [*base, *sets] for a in ("--set", s)]
    )
    return result.exit_code, [line for line in result.output.splitlines() if line.strip()]


def test_a_lora_recipe_on_megatron_passes_the_pre_flight():
    code, lines = _validate("lora.rank=8", 'lora.target_modules=["q_proj", "v_proj", "down_proj"]')
    assert code == 0, lines
    adapters = {"math": {"rank": 4}, "code": {"rank": 2, "target_modules": ["q_proj"], "lr": 0.02}}
    code, lines = _validate(f"lora={json.dumps({'adapters': adapters})}")  # multi-LoRA
    assert code == 0, lines


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["megatron.layer_spec=te"], "lora needs megatron.layer_spec local"),
        (["megatron.optimizer_streaming=true"], "megatron.optimizer_streaming is not built for lora"),
        (
            ["megatron.num_ranks=2", "megatron.tensor_parallel=2", "lora.dropout=0.1"],
            "lora.dropout 0.1 with megatron.tensor_parallel 2",
        ),
        (["transport=disk-delta"], "transport 'disk-delta' cannot carry a LoRA adapter"),
        (
            ["megatron.device=cuda", 'lora={"adapters": {"math": {"rank": 4}, "code": {"rank": 2}}}'],
            "lora.adapters (multi-LoRA) on the megatron backend runs on megatron.device cpu only so far",
        ),
        (
            [
                "megatron.num_ranks=2",
                "megatron.tensor_parallel=2",
                'lora={"adapters": {"math": {"rank": 4}, "code": {"rank": 2, "dropout": 0.1}}}',
            ],
            "lora.adapters.code.dropout 0.1 with megatron.tensor_parallel 2",
        ),
    ],
)
def test_what_megatron_lora_cannot_run_is_refused_in_one_line(sets, message):
    lora = [] if any(s.startswith("lora=") for s in sets) else ["lora.rank=8"]
    code, lines = _validate(*lora, *sets)
    assert code == 1, lines
    assert len(lines) == 1 and message in lines[0], lines


def test_the_plan_maps_hf_targets_to_megatron_slots():
    lora = LoraSection(target_modules=["q_proj", "self_attn.v_proj", "mlp.up_proj", "down_proj"])
    p = plan(QWEN3, lora)
    assert p.slots == {
        "self_attention.linear_qkv": ("q_proj", "v_proj"),
        "mlp.linear_fc1": ("up_proj",),
        "mlp.linear_fc2": ("down_proj",),
    }
    qkv = p.linear(QWEN3, "self_attention.linear_qkv")
    assert (
        qkv is not None
        and qkv.rows == (32, 16, 16)
        and qkv.groups == 2
        and qkv.targeted == ("q_proj", "v_proj")
    )
    assert p.linear(QWEN3, "self_attention.linear_proj") is None


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (
            ["q_proj", "qkv"],
            r"\['qkv'\] match no linear module of the qwen3 model; its linear modules are .*'o_proj'",
        ),
        (["lm_head"], r"does not adapt \['lm_head'\]"),
        (["model.layers.0.self_attn.q_proj"], r"adapts q_proj in layers \[0\] only"),
    ],
)
def test_targets_megatron_does_not_adapt_are_refused(targets, message):
    with pytest.raises(ConfigError, match=message):
        plan(QWEN3, LoraSection(target_modules=targets))


def test_moe_models_are_refused_and_several_adapters_planned_each():
    moe = HFModel.from_dict(
        {
            **RAW,
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
        }
    )
    with pytest.raises(ConfigError, match="adapts dense models only"):
        plan(moe, LoraSection())
    # Multi-LoRA: a plan per adapter, its factors keyed <adapter>-<part> inside the shared linears.
    section = LoraSection(
        adapters={"math": {"rank": 4, "target_modules": ["q_proj"]}, "co-de": {"rank": 2}}  # type: ignore[dict-item]
    )
    math, code = plans(QWEN3, section)
    assert (math.name, math.multi, math.key("q_proj"), math.slots) == (
        "math",
        True,
        "math-q_proj",
        {"self_attention.linear_qkv": ("q_proj",)},
    )
    assert (
        code.shape.rank == 2 and adapter_of("decoder.layers.0.mlp.linear_fc1.lora_B.co-de-up_proj") == "co-de"
    )
    assert adapter_of("decoder.layers.0.mlp.linear_fc1.lora_B.up_proj") is None
    bad = LoraSection(adapters={"math": {"target_modules": ["qkv"]}})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"lora.adapters.math.target_modules \['qkv'\] match no linear"):
        plans(QWEN3, bad)


def test_option_problems_are_one_sentence_each():
    lora = LoraSection(dropout=0.1)
    options = MegatronOptions(device="cpu", optimizer_streaming=True, num_ranks=2, tensor_parallel=2)
    problems = option_problems(options, lora, "te")
    assert len(problems) == 3 and all(p.count(";") <= 1 for p in problems)
