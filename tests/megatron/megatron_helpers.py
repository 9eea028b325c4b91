"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE checkpoints made locally (no hub) for the Megatron tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

SHAPE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)


def make_checkpoint(family: str, directory: Path, seed: int = 0, **extra: Any) -> Path:
    """Save a randomly initialised HF model of ``family`` into ``directory`` (safetensors)."""
    import transformers

    torch.manual_seed(seed)
    shape = dict(SHAPE, **extra)
    if family == "qwen2":
        shape.pop("head_dim")
        model: Any = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    elif family == "qwen3_moe":
        moe = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**dict(moe, **shape)))
    else:
        raise ValueError(family)
    with torch.no_grad():  # norms start at 1.0: make them random too so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))
