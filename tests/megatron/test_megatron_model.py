"""megatron-core's GPT model built on CPU from an HF config, loaded with converted weights (gloo, 1 rank).

Its forward pass runs on CPU with ``miles_megatron.cpu``'s pieces (megatron-core 0.16 allocates
on CUDA in three helpers, see docs/megatron.md) and gives the HF model's logits; the GPU parity
test (float32 and bf16) is in test_megatron_gpu.py.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.nn.functional as F
from megatron_helpers import checkpoint_tensors, make_checkpoint

from miles_megatron.config import MegatronOptions
from miles_megatron.convert import hf_to_megatron, megatron_to_hf
from miles_megatron.hf_config import HFModel
from miles_megatron.layout import plan_layout
from miles_megatron.parallel import megatron_parallel


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def parallel():
    layout = plan_layout(MegatronOptions())
    with megatron_parallel(layout, 0, "gloo", f"tcp://127.0.0.1:{_port()}"):
        yield layout


@pytest.mark.parametrize(
    ("family", "extra"),
    [("qwen3", dict(tie_word_embeddings=True)), ("qwen2", {}), ("qwen3_moe", dict(mlp_only_layers=[1]))],
)
def test_converted_weights_fill_the_megatron_model_exactly(parallel, tmp_path, family, extra):
    from miles_megatron.model_config import gpt_model, transformer_config

    path = make_checkpoint(family, tmp_path, **extra)
    model = HFModel.from_dir(str(path))
    hf = checkpoint_tensors(path)
    gpt = gpt_model(model, transformer_config(model, parallel, "float32", cpu_init=True))
    own = {k: v for k, v in gpt.state_dict().items() if not k.endswith("._extra_state")}
    converted = hf_to_megatron(model, hf)
    assert set(converted) == set(own)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in own.items()}
    result = gpt.load_state_dict(converted, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    exported = megatron_to_hf(model, gpt.state_dict())  # the export direction, from the live model
    assert set(exported) == set(hf)
    assert all(torch.equal(exported[k], hf[k]) for k in hf)


def test_transformer_config_fields_match_the_hf_config(parallel, tmp_path):
    from miles_megatron.model_config import gpt_args, transformer_config

    path = make_checkpoint("qwen3_moe", tmp_path, rope_theta=1e6, norm_topk_prob=True, mlp_only_layers=[0])
    model = HFModel.from_dir(str(path))
    cfg = transformer_config(model, parallel, "bfloat16", cpu_init=True)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (2, 32, 4, 2)
    assert (cfg.kv_channels, cfg.ffn_hidden_size, cfg.layernorm_epsilon) == (8, 64, 1e-6)
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and cfg.activation_func is F.silu
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.params_dtype == torch.bfloat16 and cfg.bf16
    assert (cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.moe_router_topk) == (4, 16, 2)
    assert cfg.moe_layer_freq == [0, 1]
    assert cfg.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the chosen experts
    assert cfg.moe_router_score_function == "softmax"
    args = gpt_args(model)
    assert (args.vocab_size, args.rotary_base, args.share_embeddings_and_output_weights) == (96, 1e6, False)
    dense = HFModel.from_dir(str(make_checkpoint("qwen2", tmp_path / "q2")))
    cfg = transformer_config(dense, parallel, "float32")
    assert cfg.add_qkv_bias and not cfg.qk_layernorm and cfg.num_moe_experts is None
    assert cfg.kv_channels == 8 and cfg.params_dtype == torch.float32


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("qwen3", dict(tie_word_embeddings=True)),
        ("qwen3", dict(tie_word_embeddings=False)),
        ("qwen2", {}),
        ("qwen3_moe", dict(mlp_only_layers=[1])),  # the router's gating through cpu.CPUTopKRouter
    ],
)
def test_the_cpu_forward_gives_the_hf_models_logits(parallel, tmp_path, family, extra):
    import transformers

    from miles_megatron.cpu import causal_mask
    from miles_megatron.model_config import gpt_model, transformer_config

    path = make_checkpoint(family, tmp_path, **extra)
    model = HFModel.from_dir(str(path))
    gpt = gpt_model(model, transformer_config(model, parallel, "float32", cpu_init=True), cpu=True)
    gpt.load_state_dict(hf_to_megatron(model, checkpoint_tensors(path)), strict=False)
    gpt.eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = gpt(input_ids=ids, position_ids=torch.arange(9).expand(2, 9), attention_mask=causal_mask(9))
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < 1e-5


def test_the_cpu_model_is_built_through_megatrons_spec_and_changes_no_megatron_object(parallel, tmp_path):
    """The CPU pieces are megatron's own extension points (the spec's core-attention slot, a
    ``GPTModel`` subclass): megatron's global memory buffer and RNG tracker keep their classes, a
    forward without a mask is the causal one, and attention dropout is refused."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    from miles_megatron.attention import SDPADotProductAttention
    from miles_megatron.cpu import causal_mask
    from miles_megatron.model_config import gpt_model, transformer_config

    path = make_checkpoint("qwen3", tmp_path)
    model = HFModel.from_dir(str(path))
    gpt = gpt_model(model, transformer_config(model, parallel, "float32", cpu_init=True), cpu=True)
    gpt.load_state_dict(hf_to_megatron(model, checkpoint_tensors(path)), strict=False)
    gpt.eval()
    attentions = [m for m in gpt.modules() if isinstance(m, SDPADotProductAttention)]
    assert len(attentions) == model.num_layers
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        masked = gpt(input_ids=ids, position_ids=positions, attention_mask=causal_mask(7))
        unmasked = gpt(input_ids=ids, position_ids=positions, attention_mask=None)
    torch.testing.assert_close(unmasked, masked, rtol=0, atol=1e-6)
    assert type(parallel_state.get_global_memory_buffer()) is GlobalMemoryBuffer
    assert type(mrandom.get_cuda_rng_tracker()) is mrandom.CudaRNGStatesTracker

    with pytest.raises(ValueError, match=r"attention dropout 0\.1 is not supported"):
        gpt_model(
            model,
            transformer_config(model, parallel, "float32", cpu_init=True, attention_dropout=0.1),
            cpu=True,
        )
