from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from miles_diffusion.datasets import ShapesDatasetConfig, build_shapes_dataset
from miles_diffusion.model import FlowModel, TinyFlowModelConfig, build_tiny_model
from miles_diffusion.objectives import TrainerConfig
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.recipe import recipe_from_dict
from miles_diffusion.sft import SFTConfig, SFTTrainer

CONFIG = TinyFlowModelConfig(num_prompts=2)
SENSITIVE = ("unet.time_embedding", "unet.class_embedding", "unet.*.time_emb_proj")
WATCHED = (
    "unet.time_embedding",
    "unet.time_embedding.linear_1",
    "unet.class_embedding",
    "unet.down_blocks.0.resnets.0.time_emb_proj",
    "unet.conv_in",
    "unet.down_blocks.0.resnets.0.conv1",
)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(4, 3, 16, 16, generator=gen),
        torch.tensor([0.1, 0.4, 0.7, 0.95]),
        torch.tensor([0, 1, 0, 1]),
    )


def _forward_watching(model: FlowModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    seen: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())

    def hook(name: str) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def record(module: nn.Module, args: object, output: torch.Tensor) -> None:
            seen[name] = output.detach()

        return record

    handles = [modules[name].register_forward_hook(hook(name)) for name in WATCHED]
    with torch.no_grad():
        out = model(*_inputs())
    for handle in handles:
        handle.remove()
    return out, seen


def test_named_modules_stay_fp32_while_the_rest_computes_in_bf16() -> None:
    mixed = build_tiny_model(CONFIG, seed=0, precision=PrecisionConfig("bfloat16", SENSITIVE))
    plain_bf16 = build_tiny_model(CONFIG, seed=0, precision=PrecisionConfig("bfloat16"))
    fp32 = build_tiny_model(CONFIG, seed=0)
    assert "unet.up_blocks.0.resnets.1.time_emb_proj" in mixed.fp32_modules
    assert all(p.dtype == torch.float32 for p in mixed.parameters())  # FP32 master weights
    out, seen = _forward_watching(mixed)
    assert out.dtype == torch.float32
    for name in WATCHED[:4]:
        assert seen[name].dtype == torch.float32, name
    for name in WATCHED[4:]:
        assert seen[name].dtype == torch.bfloat16, name
    ref_out, ref = _forward_watching(fp32)
    _, low = _forward_watching(plain_bf16)
    # The kept modules compute exactly what the FP32 model computes; under plain BF16 they do not.
    assert torch.equal(seen["unet.time_embedding"], ref["unet.time_embedding"])
    assert low["unet.time_embedding"].dtype == torch.bfloat16
    assert not torch.equal(low["unet.time_embedding"].float(), ref["unet.time_embedding"])
    assert not torch.equal(out, ref_out)
    assert torch.allclose(out, ref_out, atol=0.1)  # the rest of the pass in BF16: close, not equal


def test_a_bf16_train_step_updates_fp32_weights_and_a_copy_keeps_its_own_modules() -> None:
    model = build_tiny_model(CONFIG, seed=0, precision=PrecisionConfig("bfloat16", SENSITIVE))
    clone = copy.deepcopy(model)
    kept = dict(clone.named_modules())["unet.time_embedding"]
    assert getattr(kept.forward, "__self__", None) is kept  # the FP32 forward is rebound to the copy
    weight = "unet.time_embedding.linear_1.weight"
    data = build_shapes_dataset(ShapesDatasetConfig(num_images=4, held_out=0, batch_size=4), 16, 2)
    before = dict(model.named_parameters())[weight].detach().clone()
    stats = SFTTrainer(model, SFTConfig(), TrainerConfig(lr=1e-3)).train_on_batch(
        data.batch(torch.Generator().manual_seed(0)), torch.Generator().manual_seed(1)
    )
    assert torch.isfinite(torch.tensor(stats["loss"]))
    after = dict(model.named_parameters())[weight]
    assert after.dtype == torch.float32 and not torch.equal(after, before)
    assert torch.equal(dict(clone.named_parameters())[weight], before)  # the copy did not move


def test_precision_is_configured_by_the_recipe_and_checked() -> None:
    recipe = recipe_from_dict(
        {
            "name": "x",
            "evidence_level": "not verified",
            "precision": {"compute_dtype": "bfloat16", "fp32_modules": ["unet.time_embedding"]},
        }
    )
    assert recipe.precision == PrecisionConfig("bfloat16", ("unet.time_embedding",))
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        PrecisionConfig("float8")
    with pytest.raises(ValueError, match=r"'unet\.time_embeder' matches no module"):
        build_tiny_model(CONFIG, seed=0, precision=PrecisionConfig("bfloat16", ("unet.time_embeder",)))
