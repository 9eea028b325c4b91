"""megatron-core's ``TransformerConfig`` and ``GPTModel`` built from an HF config (imports megatron-core).

``transformer_config`` maps the HF fields (hidden size, heads, KV heads, head dim, FFN width,
RMS-norm epsilon, q/k norms, biases, MoE router and experts) and the run's ``ParallelLayout``
onto megatron-core's config; ``gpt_model`` builds the model with the local layer spec (or the
Transformer Engine spec when asked), the rotary base and the vocabulary taken as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from miles_megatron.hf_config import HFModel
from miles_megatron.layout import ModelShape, ParallelLayout

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped]
    from megatron.core.transformer import TransformerConfig  # type: ignore[import-untyped]

    from miles_megatron.lora import LoraPlan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class GPTArgs:
    """The ``GPTModel`` arguments that are not part of ``TransformerConfig``."""

    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    share_embeddings_and_output_weights: bool


def gpt_args(model: HFModel) -> GPTArgs:
    return GPTArgs(
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        rotary_base=model.rope_theta,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
    )


def transformer_config(
    model: HFModel,
    layout: ParallelLayout,
    params_dtype: Literal["float32", "bfloat16"] = "bfloat16",
    *,
    cpu_init: bool = False,
    **overrides: Any,
) -> TransformerConfig:
    """The megatron-core config of ``model`` under ``layout`` (``overrides``: any other config field)."""
    from megatron.core.transformer import TransformerConfig

    layout.check_model(ModelShape.of(model))
    dtype = DTYPES[params_dtype]
    fields: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_heads,
        num_query_groups=model.num_kv_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=cpu_init,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sequence_parallel,
        # Micro-batches are padded to their own longest row, so the activations passed between pipeline
        # stages change shape: each one's shape travels first (megatron's setting for that).
        variable_seq_lengths=layout.pp > 1,
    )
    if layout.pp > 1 and not model.is_moe:
        # Unused by a dense model, but megatron's config refuses its default (allgather) with
        # variable_seq_lengths.
        fields["moe_token_dispatcher_type"] = "alltoall"
    if model.is_moe:
        fields.update(
            num_moe_experts=model.num_experts,
            moe_ffn_hidden_size=model.moe_ffn_hidden,
            moe_router_topk=model.moe_topk,
            moe_layer_freq=[int(m) for m in model.moe_layers],
            moe_router_score_function="softmax",
            # HF: softmax over all experts, top-k, renormalised only with norm_topk_prob. Megatron's
            # pre-softmax router is the first; softmax over the top-k scores is the renormalised one.
            moe_router_pre_softmax=not model.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            # allgather on one EP rank (alltoall makes a CUDA stream when built, so no CPU model)
            # (and megatron's config refuses allgather with the variable shapes of pipeline stages)
            moe_token_dispatcher_type="alltoall" if layout.ep > 1 or layout.pp > 1 else "allgather",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
    fields.update(overrides)
    return TransformerConfig(**fields)


def layer_spec(
    model: HFModel,
    config: TransformerConfig,
    spec: Literal["local", "te"] = "local",
    *,
    cpu: bool = False,
    core_attention: Literal["sdpa", "megatron"] = "sdpa",
    lora: LoraPlan | tuple[LoraPlan, ...] | None = None,
) -> Any:
    """The decoder's layer spec: megatron-core's local one, or Transformer Engine's (needs it installed).

    A MoE model gets the decoder-block spec, which builds each layer as ``moe_layer_freq`` says
    (Qwen3-MoE's ``mlp_only_layers`` are dense). The local spec's ``core_attention`` slot, the
    extension point megatron gives for it, takes ``miles_megatron.attention.SDPADotProductAttention``
    unless ``core_attention`` is ``megatron`` (its own, CUDA only). ``cpu``: the spec that runs on the
    CPU (local, SDPA attention, MoE layers with ``cpu.CPUTopKRouter``). ``lora``: the linear slots it targets take
    ``miles_megatron.lora_layers``' adapter-carrying subclasses of megatron's parallel linears
    (local spec, dense models).
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if cpu and (spec == "te" or core_attention != "sdpa"):
        raise ValueError(
            "megatron.device cpu runs the local layer spec with sdpa attention only "
            f"(got {'the te spec' if spec == 'te' else 'megatron attention'})"
        )
    if spec == "te":
        if lora is not None:
            raise ValueError("LoRA layers are built on the local layer spec only")
        if model.is_moe:
            return specs.get_gpt_decoder_block_spec(
                config, use_transformer_engine=True, normalization="RMSNorm"
            )
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm)
    if model.is_moe:
        block = specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        )
        layers = block.layer_specs
    else:
        block = specs.get_gpt_layer_local_spec(qk_layernorm=model.qk_norm, normalization="RMSNorm")
        layers = [block]
    if cpu and model.is_moe:  # the router's slot (megatron's extension point for it) takes the CPU router
        from miles_megatron.cpu import CPUTopKRouter

        for layer in layers:
            if hasattr(layer.submodules.mlp.submodules, "router"):
                layer.submodules.mlp.submodules.router = CPUTopKRouter
    if core_attention == "sdpa":
        from miles_megatron.attention import SDPADotProductAttention

        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    if lora is not None:
        if model.is_moe:
            raise ValueError("LoRA layers are built for dense models only")
        _lora_slots(model, layers, lora)
    return block


def _lora_slots(model: HFModel, layers: list[Any], lora: LoraPlan | tuple[LoraPlan, ...]) -> None:
    """Put the adapter-carrying linears into the slots ``lora`` targets (megatron's spec extension points).

    Multi-LoRA (a tuple of plans): a slot's linear holds every adapter that targets it."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec  # type: ignore[import-untyped]

    from miles_megatron.lora_layers import LoraColumnParallelLinear, LoraRowParallelLinear

    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        mlp = layer.submodules.mlp.submodules
        qkv = _slot_loras(model, lora, "self_attention.linear_qkv")
        if qkv is not None:  # constructed by a direct call, not build_module: a partial keeps its argument
            attention.linear_qkv = functools.partial(LoraColumnParallelLinear, lora=qkv)
        for owner, attr, slot, cls in (
            (attention, "linear_proj", "self_attention.linear_proj", LoraRowParallelLinear),
            (mlp, "linear_fc1", "mlp.linear_fc1", LoraColumnParallelLinear),
            (mlp, "linear_fc2", "mlp.linear_fc2", LoraRowParallelLinear),
        ):
            linear = _slot_loras(model, lora, slot)
            if linear is not None:
                setattr(owner, attr, ModuleSpec(module=cls, params={"lora": linear}))


def _slot_loras(model: HFModel, lora: LoraPlan | tuple[LoraPlan, ...], slot: str) -> Any:
    """What ``slot``'s linear is built with: the plan's ``LinearLora`` (single form), the adapters' tuple
    (multi-LoRA), or None (no adapter targets it)."""
    if not isinstance(lora, tuple):
        return lora.linear(model, slot)
    linears = tuple(x for x in (p.linear(model, slot) for p in lora) if x is not None)
    return linears or None


def gpt_model(
    model: HFModel,
    config: TransformerConfig,
    spec: Literal["local", "te"] = "local",
    *,
    cpu: bool = False,
    core_attention: Literal["sdpa", "megatron"] = "sdpa",
    lora: LoraPlan | tuple[LoraPlan, ...] | None = None,
    **kwargs: Any,
) -> GPTModel:
    """megatron-core's GPT model for ``model`` (needs ``parallel_state`` initialised for ``config``'s layout).

    ``cpu``: the model that runs on the CPU (``miles_megatron.cpu``: its rotary embedding), for
    ``megatron.device: cpu``; ``core_attention`` and ``lora``: as :func:`layer_spec`."""
    from megatron.core.models.gpt import GPTModel

    model_class: type[GPTModel] = GPTModel
    if cpu:
        from miles_megatron.cpu import CPUGPTModel

        model_class = CPUGPTModel
    args = gpt_args(model)
    return model_class(
        config=config,
        transformer_layer_spec=layer_spec(
            model, config, spec, cpu=cpu, core_attention=core_attention, lora=lora
        ),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_sequence_length,
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=args.share_embeddings_and_output_weights,
        **kwargs,
    )
