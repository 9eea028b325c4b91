"""HF <-> megatron-core conversion tables (CPU): bit-exact round trips, layouts, refusals, TP shards."""

from __future__ import annotations

import re

import pytest
import torch
from megatron_helpers import checkpoint_tensors, make_checkpoint

from miles.errors import ModelError
from miles_megatron.convert import (
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    table,
    tp_shard,
    tp_unshard,
)
from miles_megatron.hf_config import HFModel

CASES = {
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False),
    "qwen3-tied": dict(tie_word_embeddings=True),
    "qwen3_moe": dict(),
    "qwen3_moe-mixed": dict(mlp_only_layers=[0]),  # layer 0 dense, layer 1 experts
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for case, extra in CASES.items():
        family = case.split("-")[0]
        out[case] = make_checkpoint(family, tmp_path_factory.mktemp(case), **extra)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spec", ["local", "te"])
def test_round_trip_is_bit_exact(checkpoints, case, spec):
    model = HFModel.from_dir(str(checkpoints[case]))
    hf = checkpoint_tensors(checkpoints[case])
    mg = hf_to_megatron(model, hf, spec)
    back = megatron_to_hf(model, mg, spec)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_tables_name_what_each_family_has(checkpoints):
    q2 = HFModel.from_dir(str(checkpoints["qwen2"]))
    names = {r.megatron for r in table(q2)}
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert "decoder.layers.0.self_attention.q_layernorm.weight" not in names
    assert "output_layer.weight" not in names  # tied
    moe = HFModel.from_dir(str(checkpoints["qwen3_moe-mixed"]))
    names = {r.megatron for r in table(moe)}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert "decoder.layers.1.mlp.router.weight" in names
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in names
    assert "decoder.layers.0.mlp.router.weight" not in names
    te = {r.megatron for r in table(q2, "te")}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te


def test_qkv_is_grouped_per_kv_head(checkpoints):
    model = HFModel.from_dir(str(checkpoints["qwen3"]))
    hf = checkpoint_tensors(checkpoints["qwen3"])
    qkv = hf_to_megatron(model, hf)["decoder.layers.1.self_attention.linear_qkv.weight"]
    d, per = model.head_dim, model.num_heads // model.num_kv_heads
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    rows = (per + 2) * d
    for g in range(model.num_kv_heads):
        block = qkv[g * rows : (g + 1) * rows]
        assert torch.equal(block[: per * d], q[g * per * d : (g + 1) * per * d])
        assert torch.equal(block[per * d : per * d + d], k[g * d : (g + 1) * d])
        assert torch.equal(block[per * d + d :], v[g * d : (g + 1) * d])
    bias = fuse_qkv(model, torch.arange(32.0), torch.arange(100.0, 116.0), torch.arange(200.0, 216.0))
    assert bias[:16].tolist() == list(range(16)) and bias[16:24].tolist() == list(range(100, 108))


def test_fc1_is_gate_then_up(checkpoints):
    model = HFModel.from_dir(str(checkpoints["qwen3_moe"]))
    hf = checkpoint_tensors(checkpoints["qwen3_moe"])
    fc1 = hf_to_megatron(model, hf)["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"]
    gate = hf["model.layers.0.mlp.experts.2.gate_proj.weight"]
    up = hf["model.layers.0.mlp.experts.2.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))


def test_missing_and_leftover_tensors_are_refused(checkpoints):
    model = HFModel.from_dir(str(checkpoints["qwen3"]))
    hf = checkpoint_tensors(checkpoints["qwen3"])
    with pytest.raises(ModelError, match=re.escape("no model.layers.1.self_attn.k_norm.weight")):
        hf_to_megatron(model, {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_norm.weight"})
    with pytest.raises(ModelError, match=re.escape("model.layers.9.extra")):
        hf_to_megatron(model, {**hf, "model.layers.9.extra": torch.zeros(1)})
    mg = hf_to_megatron(model, hf)
    with pytest.raises(ModelError, match=re.escape("no output_layer.weight")):
        megatron_to_hf(model, {k: v for k, v in mg.items() if k != "output_layer.weight"})
    with pytest.raises(ModelError, match="rows"):
        bad = dict(hf, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)})
        hf_to_megatron(model, bad)


def test_unsupported_configs_are_refused():
    base = dict(
        model_type="qwen3",
        vocab_size=8,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )
    assert HFModel.from_dict(base).rope_theta == 1e6
    with pytest.raises(ModelError, match="llama"):
        HFModel.from_dict(dict(base, model_type="llama"))
    with pytest.raises(ModelError, match="yarn"):
        HFModel.from_dict(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ModelError, match="sliding"):
        HFModel.from_dict(dict(base, model_type="qwen2", use_sliding_window=True))


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_shards_put_back_together(checkpoints, tp):
    model = HFModel.from_dir(str(checkpoints["qwen2"]))
    mg = hf_to_megatron(model, checkpoint_tensors(checkpoints["qwen2"]))
    for name, full in mg.items():
        shards = [tp_shard(name, full, tp, r) for r in range(tp)]
        assert torch.equal(tp_unshard(name, shards), full), name
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    if tp == 2:  # each rank holds its half of the gate rows then its half of the up rows
        gate, up = fc1.chunk(2)
        assert torch.equal(tp_shard("x.linear_fc1.weight", fc1, 2, 1), torch.cat([gate[32:], up[32:]]))
        proj = mg["decoder.layers.0.self_attention.linear_proj.weight"]
        assert tp_shard("x.linear_proj.weight", proj, 2, 0).shape == (32, 16)
