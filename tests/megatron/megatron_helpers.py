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


def make_batch(n: int = 5, seed: int = 0, step: int = 0, vocab: int = 96, positive: bool = False):
    """A random train batch over ``vocab`` tokens: prompts of 2-6 tokens, responses of 1-7, one masked token."""
    import random

    from miles.types import Prompt, Sample, TrainBatch

    rng = random.Random(seed)
    samples, advantages = [], []
    for i in range(n):
        p, r = rng.randint(2, 6), rng.randint(1, 7)
        mask = [1] * r
        if r > 2:
            mask[rng.randrange(r)] = 0
        samples.append(
            Sample(
                prompt=Prompt(index=i, prompt=f"p{i}"),
                prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                response_ids=[rng.randrange(vocab) for _ in range(r)],
                rollout_logprobs=[-(i * 100 + j + 1) / 1000.0 for j in range(r)],
                loss_mask=mask,
                weight_versions=[0] * r,
            )
        )
        advantages.append([1.0 if positive else rng.choice([-1.0, 0.5, 1.0])] * r)
    return TrainBatch(samples=samples, advantages=advantages, step=step)
