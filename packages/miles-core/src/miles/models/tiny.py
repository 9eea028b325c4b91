"""Tiny Qwen3-shaped checkpoints built from config with seeded random weights.

They are real Hugging Face models (``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``) that
every component can load like any other checkpoint, small enough for CPU tests and
for the default recipe, which trains one from scratch on single-digit addition.
The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.models.tokenizer import ENDOFTEXT, IM_END, build_tokenizer

# Shared by both tiny models: GQA with 4 query heads over 2 KV heads of width 16.
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}

DENSE: dict[str, Any] = {**_COMMON, "num_hidden_layers": 4, "intermediate_size": 192}

MOE: dict[str, Any] = {
    **_COMMON,
    "num_hidden_layers": 2,
    "intermediate_size": 128,  # unused with an MoE block in every layer, kept for tools that read it
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def build_tiny_qwen3(dest: Path, seed: int = 0) -> None:
    """Write the dense tiny model (``Qwen3ForCausalLM``, about 0.2M parameters) into ``dest``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _build(dest, seed, Qwen3Config, Qwen3ForCausalLM, DENSE)


def build_tiny_qwen3_moe(dest: Path, seed: int = 0) -> None:
    """Write the MoE tiny model (``Qwen3MoeForCausalLM``, 4 experts, top-2) into ``dest``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _build(dest, seed, Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE)


def _build(dest: Path, seed: int, config_cls: Any, model_cls: Any, shape: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = config_cls(
        vocab_size=len(tokenizer),
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="float32",
        **shape,
    )
    config.architectures = [model_cls.__name__]

    # Seed a private generator state so building never disturbs the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None
    )
    from transformers.utils import logging as hf_logging

    # A sub-second save needs no progress bar in the middle of `miles models build` output.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(dest)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(dest)
    _add_legacy_config_keys(Path(dest) / "config.json")
    _make_tokenizer_config_portable(Path(dest) / "tokenizer_config.json")


def _add_legacy_config_keys(path: Path) -> None:
    # transformers 5 renamed Qwen3-MoE's ``num_experts`` to ``num_local_experts``; readers built on
    # transformers 4 (SGLang among them) still look for the old key and would default to 128 experts.
    config = json.loads(path.read_text())
    if "num_local_experts" in config and "num_experts" not in config:
        config["num_experts"] = config["num_local_experts"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _make_tokenizer_config_portable(path: Path) -> None:
    # transformers 5 writes its own backend class name; the generic fast class loads on 4.x too
    # (SGLang servers often pin transformers 4).
    config = json.loads(path.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
