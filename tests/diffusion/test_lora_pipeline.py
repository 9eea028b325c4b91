"""LoRA on a pipeline family's transformer (SD3, Wan), in one process: the adapter wraps the
transformer alone, its factors travel under the engine's names (``transformer.<module>.lora_A.<name>.weight``),
the engine merges each update onto its unmerged transformer (``W_base + alpha/r * B A``, checked
against the factors and against peft's own ``merge_and_unload``), and the recipe checks refuse targets
the transformer lacks or cannot merge, before any weights load.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from miles.config import load_recipe
from miles.config.schema import LoraSection
from miles.engines.client import HANDOFF_LOAD_FORMAT
from miles.errors import ConfigError
from miles.models.registry import resolve_model
from miles_diffusion import lora as lora_mod
from miles_diffusion.checks import check_recipe
from miles_diffusion.engine.server import DiffusionEngine, LoadLoraBody, UpdateFromTensorBody
from miles_diffusion.families import load_model

# family -> (model, targets, the number of adapted Linear layers, the adapter's bytes at rank 4)
FAMILIES = {
    "sd3": (
        "builtin:tiny-sd3",
        ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
        15,
    ),
    "wan": ("builtin:tiny-wan", ["to_q", "to_k", "to_v", "to_out.0"], 16),
}
PROMPTS = ("a red apple", "a blue sky")


def _randomise(peft_model: object, seed: int) -> None:
    """Every factor away from its initial value (B starts at zero, which would merge to nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():  # type: ignore[attr-defined]
            if ".lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_merges_the_transformers_adapter_as_base_plus_scaled_ba(
    family: str, tmp_path: Path
) -> None:
    ref, targets, n_layers = FAMILIES[family]
    path = resolve_model(ref)
    lora = LoraSection(rank=4, alpha=8, target_modules=targets)
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    engine = DiffusionEngine(path, handoff_dir=str(handoff))
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}

    model = load_model(path, prompts=PROMPTS)
    peft_model = lora_mod.wrap(model, lora, path)
    assert peft_model.get_base_model() is model.transformer  # the adapter wraps the transformer alone
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and n.startswith("transformer.") for n in trainable)
    covered = lora_mod.check_targets(lora_mod.root_on_meta(path), lora)
    assert len(covered) == n_layers

    initial = lora_mod.save_adapter(peft_model, tmp_path / "initial")
    engine.load_lora(LoadLoraBody(lora_name=lora.name, lora_path=str(initial)))
    assert all(torch.equal(engine.model.state_dict()[k], base[k]) for k in base)  # B = 0: the base

    _randomise(peft_model, 1)
    tensors = {n: t.contiguous() for n, t in lora_mod.adapter_tensors(peft_model, lora.name, "transformer.")}
    assert all(
        n.startswith("transformer.") and f".lora_{n.split('.lora_')[1][0]}.{lora.name}." in n for n in tensors
    )
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == lora_mod.adapter_bytes(peft_model)
    save_file(tensors, str(handoff / "v1.safetensors"))
    engine.update_bucket(
        UpdateFromTensorBody(
            serialized_named_tensors=["v1.safetensors"],
            load_format=HANDOFF_LOAD_FORMAT,
            weight_version="1",
            bucket_index=0,
        )
    )
    assert engine.weight_version == 1

    merged = engine.model.state_dict()
    scale = lora.alpha / lora.rank
    adapted = {f"transformer.{m}.weight" for m in covered}
    for module in covered:
        a = tensors[f"transformer.{module}.lora_A.{lora.name}.weight"]
        b = tensors[f"transformer.{module}.lora_B.{lora.name}.weight"]
        key = f"transformer.{module}.weight"
        torch.testing.assert_close(merged[key], base[key] + scale * (b @ a), rtol=0, atol=1e-6)
        assert not torch.allclose(merged[key], base[key], atol=1e-4)
    assert all(torch.equal(merged[k], base[k]) for k in base if k not in adapted)  # untouched bit for bit

    # peft's own merge of the trainer's adapter into its transformer agrees.
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    for key in adapted:
        torch.testing.assert_close(
            merged[key], reference[key.removeprefix("transformer.")], rtol=0, atol=1e-6
        )


@pytest.mark.parametrize(
    ("recipe", "targets", "message"),
    [
        (
            "sd3_flow_grpo_proxy_lora",
            "[to_q, norm1]",
            r"'norm1' matches 'transformer_blocks.0.norm1', a AdaLayerNormZero",
        ),
        ("sd3_flow_grpo_proxy_lora", "[to_q, conv1]", r"'conv1' matches no module of the denoiser; .*'to_q'"),
        ("wan_flow_grpo_proxy_lora", "[norm_q]", r"'norm_q' matches 'blocks.0.attn1.norm_q', a RMSNorm"),
        ("wan_flow_grpo_proxy_lora", "[add_q_proj]", r"'add_q_proj' matches no module of the denoiser"),
    ],
)
def test_targets_the_transformer_lacks_or_cannot_merge_are_refused_before_anything_loads(
    recipe: str, targets: str, message: str
) -> None:
    config = load_recipe(recipe, [f"lora.target_modules={targets}"])
    with pytest.raises(ConfigError, match=message):
        check_recipe(config)


@pytest.mark.parametrize("recipe", ["sd3_flow_grpo_proxy_lora", "wan_flow_grpo_proxy_lora"])
def test_the_shipped_pipeline_lora_recipes_pass_the_checks(recipe: str) -> None:
    check_recipe(load_recipe(recipe, []))
