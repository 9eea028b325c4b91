"""Hugging Face <-> megatron-core weight conversion for Qwen2, Qwen3 and Qwen3-MoE: one table per family.

Each table is a list of ``Rule``s, one per megatron-core parameter of a layer (or of the model):
its megatron name, the HF checkpoint name(s) it is made of and how (``copy``; ``qkv``: q, k, v
fused per query group as megatron's ``linear_qkv`` lays them out; ``gate_up``: the SwiGLU gate
and up projections stacked into ``linear_fc1``, gate first). HF names are the checkpoint's own
(``model.safetensors``: per-expert ``experts.{e}.gate_proj.weight``), which is what an HF
directory holds and what engines load.

Tensors are the full (TP = 1) ones; ``tp_shard`` cuts a full tensor into its TP shard the way
megatron-core's column/row-parallel layers hold it and ``tp_unshard`` puts the shards back.

Both directions consume every input tensor and refuse a missing or left-over name, so a table
that forgets a parameter fails loudly instead of dropping it. ``spec`` is the megatron layer
spec the names belong to: ``local`` (``get_gpt_layer_local_spec``) or ``te`` (Transformer
Engine, whose fused linears own the layer norms: ``linear_qkv.layer_norm_weight`` and, in dense
layers, ``linear_fc1.layer_norm_weight``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from miles.errors import ModelError
from miles_megatron.hf_config import HFModel

Kind = Literal["copy", "qkv", "gate_up"]
Spec = Literal["local", "te"]


@dataclass(frozen=True)
class Rule:
    """One megatron-core parameter and the HF parameter(s) it is built from."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind = "copy"


def _copy(megatron: str, hf: str) -> Rule:
    return Rule(megatron, (hf,))


# ------------------------------------------------------------------ the tables


def _attention(model: HFModel, spec: Spec) -> list[Rule]:
    m, h = "decoder.layers.{i}.self_attention", "model.layers.{i}.self_attn"
    norm = (
        f"{m}.linear_qkv.layer_norm_weight" if spec == "te" else "decoder.layers.{i}.input_layernorm.weight"
    )
    rules = [
        _copy(norm, "model.layers.{i}.input_layernorm.weight"),
        Rule(
            f"{m}.linear_qkv.weight",
            (f"{h}.q_proj.weight", f"{h}.k_proj.weight", f"{h}.v_proj.weight"),
            "qkv",
        ),
        _copy(f"{m}.linear_proj.weight", f"{h}.o_proj.weight"),
    ]
    if model.qkv_bias:
        rules.append(
            Rule(f"{m}.linear_qkv.bias", (f"{h}.q_proj.bias", f"{h}.k_proj.bias", f"{h}.v_proj.bias"), "qkv")
        )
    if model.qk_norm:
        rules += [
            _copy(f"{m}.q_layernorm.weight", f"{h}.q_norm.weight"),
            _copy(f"{m}.k_layernorm.weight", f"{h}.k_norm.weight"),
        ]
    return rules


def _dense_mlp(spec: Spec) -> list[Rule]:
    m, h = "decoder.layers.{i}.mlp", "model.layers.{i}.mlp"
    norm = (
        f"{m}.linear_fc1.layer_norm_weight" if spec == "te" else "decoder.layers.{i}.pre_mlp_layernorm.weight"
    )
    return [
        _copy(norm, "model.layers.{i}.post_attention_layernorm.weight"),
        Rule(f"{m}.linear_fc1.weight", (f"{h}.gate_proj.weight", f"{h}.up_proj.weight"), "gate_up"),
        _copy(f"{m}.linear_fc2.weight", f"{h}.down_proj.weight"),
    ]


def _moe_mlp(model: HFModel) -> list[Rule]:
    m, h = "decoder.layers.{i}.mlp", "model.layers.{i}.mlp"
    rules = [
        _copy(
            "decoder.layers.{i}.pre_mlp_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight"
        ),
        _copy(f"{m}.router.weight", f"{h}.gate.weight"),
    ]
    for e in range(model.num_experts):
        x, y = f"{m}.experts.local_experts.{e}", f"{h}.experts.{e}"
        rules += [
            Rule(f"{x}.linear_fc1.weight", (f"{y}.gate_proj.weight", f"{y}.up_proj.weight"), "gate_up"),
            _copy(f"{x}.linear_fc2.weight", f"{y}.down_proj.weight"),
        ]
    return rules


def _globals(model: HFModel) -> list[Rule]:
    rules = [
        _copy("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        _copy("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not model.tie_word_embeddings:  # tied: megatron shares the embedding, HF omits lm_head
        rules.append(_copy("output_layer.weight", "lm_head.weight"))
    return rules


def qwen2_table(model: HFModel, spec: Spec = "local") -> list[Rule]:
    """Qwen2: q/k/v biases, no q/k norms, dense SwiGLU MLP."""
    return _layers(model, lambda i: _attention(model, spec) + _dense_mlp(spec))


def qwen3_table(model: HFModel, spec: Spec = "local") -> list[Rule]:
    """Qwen3 dense: q/k RMS norms over each head, no biases, dense SwiGLU MLP."""
    return _layers(model, lambda i: _attention(model, spec) + _dense_mlp(spec))


def qwen3_moe_table(model: HFModel, spec: Spec = "local") -> list[Rule]:
    """Qwen3-MoE: Qwen3 attention; a top-k router and per-expert SwiGLU MLPs (dense MLP in ``mlp_only_layers``)."""
    return _layers(
        model,
        lambda i: _attention(model, spec) + (_moe_mlp(model) if model.layer_is_moe(i) else _dense_mlp(spec)),
    )


TABLES = {"qwen2": qwen2_table, "qwen3": qwen3_table, "qwen3_moe": qwen3_moe_table}


def _layers(model: HFModel, layer_rules: Callable[[int], list[Rule]]) -> list[Rule]:
    rules = _globals(model)
    for i in range(model.num_layers):
        for r in layer_rules(i):
            rules.append(Rule(r.megatron.format(i=i), tuple(n.format(i=i) for n in r.hf), r.kind))
    return rules


def table(model: HFModel, spec: Spec = "local") -> list[Rule]:
    """The conversion rules of ``model`` (its family's table, expanded over layers and experts)."""
    return TABLES[model.family](model, spec)


# ------------------------------------------------------------------ layouts


def fuse_qkv(model: HFModel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v (weights ``[heads*d, hidden]`` or biases ``[heads*d]``) into megatron's per-group layout.

    ``linear_qkv`` holds, for each key/value group g: the group's query heads, then k_g, then v_g.
    """
    groups, d = model.num_kv_heads, model.head_dim
    per = model.num_heads // groups
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    return fused.reshape(groups * (per + 2) * d, *rest)


def split_qkv(model: HFModel, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``fuse_qkv``."""
    groups, d = model.num_kv_heads, model.head_dim
    per = model.num_heads // groups
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _check_shape(name: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.shape[0] != rows:
        raise ModelError(f"megatron: {name} has {tensor.shape[0]} rows, the config implies {rows}")


def _to_megatron(model: HFModel, rule: Rule, parts: list[torch.Tensor]) -> torch.Tensor:
    if rule.kind == "copy":
        return parts[0]
    if rule.kind == "qkv":
        q, k, v = parts
        _check_shape(rule.hf[0], q, model.num_heads * model.head_dim)
        _check_shape(rule.hf[1], k, model.num_kv_heads * model.head_dim)
        _check_shape(rule.hf[2], v, model.num_kv_heads * model.head_dim)
        return fuse_qkv(model, q, k, v)
    gate, up = parts
    if gate.shape != up.shape:
        raise ModelError(
            f"megatron: {rule.hf[0]} {tuple(gate.shape)} and {rule.hf[1]} {tuple(up.shape)} differ"
        )
    return torch.cat([gate, up], dim=0)


def rule_to_hf(model: HFModel, rule: Rule, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The HF tensor(s) ``rule.hf`` of the full megatron tensor ``rule.megatron`` (weight export)."""
    return _to_hf(model, rule, tensor)


def _to_hf(model: HFModel, rule: Rule, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if rule.kind == "copy":
        return (tensor,)
    if rule.kind == "qkv":
        _check_shape(rule.megatron, tensor, (model.num_heads + 2 * model.num_kv_heads) * model.head_dim)
        return split_qkv(model, tensor)
    gate, up = tensor.chunk(2, dim=0)
    return gate, up


# ------------------------------------------------------------------ whole state dicts


def _leftover(names: set[str], what: str) -> None:
    if names:
        shown = ", ".join(sorted(names)[:5]) + (" ..." if len(names) > 5 else "")
        raise ModelError(f"megatron: {len(names)} {what} tensor(s) no conversion rule uses: {shown}")


def hf_to_megatron(
    model: HFModel, hf_state: Mapping[str, torch.Tensor], spec: Spec = "local"
) -> dict[str, torch.Tensor]:
    """The megatron-core (TP = 1) state dict of an HF checkpoint's tensors."""
    return dict(iter_hf_to_megatron(model, hf_state, spec))


def iter_hf_to_megatron(
    model: HFModel, hf_state: Mapping[str, torch.Tensor], spec: Spec = "local"
) -> Iterator[tuple[str, torch.Tensor]]:
    unused = set(hf_state)
    if model.tie_word_embeddings:
        unused.discard("lm_head.weight")  # some tied checkpoints still store it; the embedding wins
    for rule in table(model, spec):
        missing = [n for n in rule.hf if n not in hf_state]
        if missing:
            raise ModelError(f"megatron: the HF checkpoint has no {missing[0]} (needed for {rule.megatron})")
        unused.difference_update(rule.hf)
        yield rule.megatron, _to_megatron(model, rule, [hf_state[n] for n in rule.hf])
    _leftover(unused, "HF")


def megatron_to_hf(
    model: HFModel, megatron_state: Mapping[str, torch.Tensor], spec: Spec = "local"
) -> dict[str, torch.Tensor]:
    """HF checkpoint names and layouts of a megatron-core (TP = 1) state dict (for weight export)."""
    return dict(iter_megatron_to_hf(model, megatron_state, spec))


def iter_megatron_to_hf(
    model: HFModel, megatron_state: Mapping[str, torch.Tensor], spec: Spec = "local"
) -> Iterator[tuple[str, torch.Tensor]]:
    unused = {n for n in megatron_state if not n.endswith("._extra_state")}
    for rule in table(model, spec):
        if rule.megatron not in megatron_state:
            raise ModelError(f"megatron: the megatron state dict has no {rule.megatron}")
        unused.discard(rule.megatron)
        yield from zip(rule.hf, _to_hf(model, rule, megatron_state[rule.megatron]), strict=True)
    _leftover(unused, "megatron")


# ------------------------------------------------------------------ tensor-parallel shards

# Column-parallel (output rows split) and row-parallel (input columns split) parameters, by name suffix.
_COLUMN = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "word_embeddings.weight",
    "output_layer.weight",
)
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def tp_dim(name: str) -> int | None:
    """The dimension ``name`` is split along under tensor parallelism (None: replicated)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def tp_shard(name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``name`` under TP = ``tp``.

    ``linear_fc1`` holds [gate; up] on every rank, so each half is split on its own; q/k/v are
    already grouped per key/value group, so a contiguous split gives each rank whole groups.
    """
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return tensor
    if name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    if tensor.shape[dim] % tp:
        raise ModelError(
            f"megatron: {name} dimension {dim} ({tensor.shape[dim]}) does not split over TP={tp}"
        )
    return tensor.chunk(tp, dim=dim)[rank]


def tp_unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor ``name`` from its TP shards in rank order (the inverse of ``tp_shard``)."""
    dim = tp_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)
