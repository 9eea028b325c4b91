"""The package driver (``python -m miles_diffusion.train``) with a recipe's ``lora`` section on the SD3
and Wan proxies: the adapter wraps the transformer, only its factors train, and ``--out`` receives it
as a peft directory that loads onto the base transformer; bad targets and FSDP ranks are refused.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles.config.schema import LoraSection
from miles_diffusion import lora as lora_mod
from miles_diffusion.recipe import DiffusionRecipe, load_recipe
from miles_diffusion.train import ADAPTER_DIR, _wrap_lora, build_recipe_model, resolve_model_dir, run

RECIPES = {
    "sd3_flow_grpo_proxy_lora": "SD3Transformer2DModel",
    "wan_flow_grpo_proxy_lora": "WanTransformer3DModel",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_driver_trains_and_writes_the_transformers_adapter(name: str, tmp_path: Path) -> None:
    recipe = replace(load_recipe(name), num_iterations=2)
    assert recipe.lora is not None and isinstance(recipe.model, str)
    history = run(recipe, tmp_path)
    assert len(history) == 2 and all(m["train/grad_norm"] > 0 for m in history)

    import diffusers
    from peft import PeftModel

    base_dir = resolve_model_dir(recipe.model)
    cls = getattr(diffusers, RECIPES[name])
    loaded = PeftModel.from_pretrained(
        cls.from_pretrained(base_dir, subfolder="transformer"), str(tmp_path / ADAPTER_DIR)
    )
    b = [p for n, p in loaded.named_parameters() if ".lora_B." in n]
    assert b and any(float(p.detach().abs().max()) > 0 for p in b)  # trained, not the initial B = 0


def test_only_the_adapter_trains_in_the_driver() -> None:
    recipe = load_recipe("sd3_flow_grpo_proxy_lora")
    assert recipe.lora is not None and isinstance(recipe.model, str)
    model = build_recipe_model(recipe)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = _wrap_lora(recipe, model)
    assert peft_model.get_base_model() is model.transformer
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # the objective's AdamW takes these alone
    state = lora_mod.adapter_state(peft_model)
    assert all(float(t.abs().max()) == 0 for k, t in state.items() if ".lora_B." in k)  # B = 0
    covered = lora_mod.check_targets(lora_mod.root_on_meta(resolve_model_dir(recipe.model)), recipe.lora)
    wrapped = model.state_dict()
    for module in covered:  # the adapted layers keep the base's weights, unchanged, beside the factors
        key = f"transformer.{module}.weight"
        assert torch.equal(wrapped[key.replace(".weight", ".base_layer.weight")], base[key])


def test_the_driver_refuses_bad_lora_recipes() -> None:
    recipe = load_recipe("wan_flow_grpo_proxy_lora")
    bad: DiffusionRecipe = replace(recipe, lora=LoraSection(rank=4, alpha=8, target_modules=["norm_q"]))
    with pytest.raises(ValueError, match=r"'norm_q' matches 'blocks.0.attn1.norm_q', a RMSNorm"):
        _wrap_lora(bad, build_recipe_model(bad))
    with pytest.raises(ValueError, match=r"lora: the driver trains an adapter on one rank only"):
        replace(recipe, trainer=replace(recipe.trainer, fsdp_ranks=2))
