"""What the Megatron backend reads from a Hugging Face ``config.json`` (Qwen2, Qwen3, Qwen3-MoE).

``HFModel.from_dict`` checks the model type and the features the conversion supports and
refuses the rest in one sentence; it imports neither torch nor megatron-core.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from miles.errors import ModelError

# model_type -> family (the conversion table in ``convert`` that handles it)
FAMILIES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


@dataclass(frozen=True)
class HFModel:
    """The shape of one HF decoder-only model, in the terms the conversion and config builder use."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0  # 0: dense
    moe_ffn_hidden: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()  # per layer: True where the MLP is a mixture of experts

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        return self.is_moe and self.moe_layers[layer]

    @classmethod
    def from_dir(cls, path: str) -> HFModel:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> HFModel:
        model_type = hf.get("model_type")
        family = FAMILIES.get(str(model_type))
        if family is None:
            raise ModelError(
                f"megatron: model_type {model_type!r} has no conversion table; supported: {sorted(FAMILIES)}"
            )
        if hf.get("use_sliding_window"):
            raise ModelError(f"megatron: {model_type} with use_sliding_window is not supported")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelError(f"megatron: rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", hf.get("rope_theta"))
        if theta is None:
            raise ModelError("megatron: config.json gives no rope_theta")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        layers = int(hf["num_hidden_layers"])
        experts = (
            int(hf.get("num_experts") or hf.get("num_local_experts") or 0) if family == "qwen3_moe" else 0
        )
        moe_layers: tuple[bool, ...] = ()
        if experts:
            step = int(hf.get("decoder_sparse_step", 1))
            dense_only = set(hf.get("mlp_only_layers") or [])
            moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        return cls(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            ffn_hidden=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope_theta=float(theta),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            moe_ffn_hidden=int(hf.get("moe_intermediate_size") or 0) if experts else 0,
            moe_topk=int(hf.get("num_experts_per_tok") or 0) if experts else 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layers=moe_layers,
        )
