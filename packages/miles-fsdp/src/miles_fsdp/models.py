"""The models a rank holds, loaded from Hugging Face checkpoints and sharded with FSDP2.

* the **policy** (trained, exported, sent to the engines);
* **frozen scorers**: the reference policy (KL penalties) and an in-process teacher
  (on-policy distillation), forward-only;
* the **critic** of PPO: the policy's backbone with a scalar value head, trained with
  its own optimizer.

All of them read log-probs or values at the same positions (the logits row that
predicts each response token), so one micro-batch layout serves every model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from miles.errors import ModelError
from miles_fsdp import attention
from miles_fsdp.config import FSDPOptions

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: HF marks them in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        for mod in model.modules():
            if isinstance(mod, nn.ModuleList) and len(mod) > 0:
                layers = list(mod)
                break
    return layers


def load_config(path: str, role: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"fsdp: cannot load the {role}'s Hugging Face config from {path!r}: {exc}") from exc


def source_dtype(config: Any) -> torch.dtype:
    """The checkpoint's own dtype (loading in float32 rewrites the config's, so read it first)."""
    dtype = getattr(config, "dtype", None) or torch.float32
    return DTYPES.get(dtype, torch.float32) if isinstance(dtype, str) else dtype


def load_causal_lm(path: str, opts: FSDPOptions, role: str) -> PreTrainedModel:
    """A causal LM in float32 master weights (``param_dtype`` only changes the gathered compute copies)."""
    from transformers import AutoModelForCausalLM

    load_config(path, role)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    attn = attention_backend(opts)
    if attn:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if attn == attention.NAME:
        attention.check_model(model, role)
    model.config.use_cache = False  # training and scoring never decode
    return model


def attention_backend(opts: FSDPOptions) -> str | None:
    """The transformers attention backend the models load with.

    The one the recipe names; else, for packed micro-batches, ``miles_varlen`` (attention within each
    sample from its boundaries, no mask); else transformers' default.
    """
    if opts.attn_implementation:
        return opts.attn_implementation
    if opts.max_tokens_per_gpu is not None:
        attention.register()
        return attention.NAME
    return None


class ValueModel(nn.Module):
    """A critic: a Hugging Face backbone (``AutoModel``) and a linear head giving one value per position.

    The head starts at zero, so the first values are 0 and the first advantages are the
    plain returns instead of noise from a random head.
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self._no_split_modules = getattr(backbone, "_no_split_modules", None)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **attention_kwargs: Any
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, position_ids=position_ids, **attention_kwargs
        ).last_hidden_state
        # A fresh tensor, not a view: FSDP2 hooks the root module's output for backward.
        return self.value_head(hidden).squeeze(-1).float().clone()


def load_value_model(path: str, opts: FSDPOptions) -> ValueModel:
    from transformers import AutoModel

    config = load_config(path, "critic")
    if not hasattr(config, "hidden_size"):
        raise ModelError(
            f"fsdp: the critic's config at {path!r} has no hidden_size; cannot attach a value head"
        )
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    attn = attention_backend(opts)
    if attn:
        kwargs["attn_implementation"] = attn
    from transformers.utils import logging as hf_logging

    # A causal-LM checkpoint has an lm_head the backbone does not take; that is expected, not news.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        backbone = AutoModel.from_pretrained(path, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    if attn == attention.NAME:
        attention.check_model(backbone, "critic")
    backbone.config.use_cache = False
    return ValueModel(backbone)


def shard(
    model: nn.Module,
    mesh: DeviceMesh,
    opts: FSDPOptions,
    role: str,
    layers: list[nn.Module] | None = None,
) -> nn.Module:
    """FSDP2 over the decoder layers, then the root; gradients are summed across ranks, not averaged.

    ``layers``: the blocks to shard one by one (default: :func:`decoder_layers`, the Hugging Face
    decoder layers); another model family (e.g. a diffusion denoiser) names its own."""
    if layers is None:
        layers = decoder_layers(model)
    if not layers:
        raise ModelError(f"fsdp: found no decoder layers to shard in the {role} ({type(model).__name__})")
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[opts.param_dtype] if opts.param_dtype else None,
        reduce_dtype=DTYPES[opts.reduce_dtype] if opts.reduce_dtype else None,
    )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=opts.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=opts.reshard_after_forward)
    if opts.compile:
        compile_layers(layers, opts.compile_backend)
    # The loss is already divided by the global token count, so ranks' gradients must be
    # summed, not averaged: a plain SUM reduce-scatter with no division.
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_force_sum_reduction_for_comms(True)
            mod.set_gradient_divide_factor(1.0)
    return model


def compile_layers(layers: list[nn.Module], backend: str) -> None:
    """``torch.compile`` every decoder layer in place (``nn.Module.compile``: names and state dicts
    are unchanged, so checkpoints, exports and weight updates see the same parameters).

    A layer, not the whole model: the layers are identical, so one compiled graph serves all of
    them (parameters are graph inputs), the compile stays small, and FSDP2's per-layer hooks, which
    dynamo skips, run eagerly around each compiled layer. Shapes change between micro-batches
    (padded lengths, packed token counts), so they are compiled dynamic from the second shape on.
    """
    import torch._dynamo

    # Each new shape recompiles once before dynamo marks it dynamic; room for the layers' variants
    # (training, no_grad scoring) beyond torch's default of 8 per code object.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile(backend=backend)


def check_projectable(model: nn.Module, role: str) -> None:
    """Refuse ``fsdp.logprob_projection: chunked`` for a model whose logits are more than its head's
    linear output: the chunked path computes ``linear(hidden)`` itself and would skip the rest."""
    config = getattr(model, "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        raise ModelError(
            f"fsdp: the {role} softcaps its logits (final_logit_softcapping={softcap}); "
            "fsdp.logprob_projection 'chunked' projects hidden states plainly, use 'full'"
        )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        raise ModelError(
            f"fsdp: the {role}'s output head is {type(head).__name__}, not a Linear layer; "
            "fsdp.logprob_projection 'chunked' needs one, use 'full'"
        )


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
