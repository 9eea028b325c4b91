"""megatron-core on CPU over gloo (``megatron.device: cpu``): the pieces its CUDA path hard-codes.

megatron-core 0.16's tensor-parallel layers (column- and row-parallel linears, the
vocab-parallel embedding) and the GPT model run on CPU over gloo, but three modules on the
forward path allocate on ``torch.cuda.current_device()`` unconditionally. Each is replaced
through megatron's own construction API, by subclasses built in its place (nothing of
megatron-core is patched, and no existing object changes class):

- core attention: the local spec's ``DotProductAttention`` takes its score matrix from the
  global memory buffer (``utils.GlobalMemoryBuffer.get_tensor``, on CUDA) and forks the CUDA
  RNG tracker around its dropout. ``miles_megatron.attention.SDPADotProductAttention`` keeps megatron's constructor
  (heads per partition, softmax scale) and computes the same attention with torch's
  ``scaled_dot_product_attention``; it is put into the layer spec's ``core_attention`` slot, the
  extension point megatron gives for it (``model_config.layer_spec``). Dropout is refused (the
  HF families here have none), so no RNG tracker is ever needed;
- ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to CUDA on its first call
  (``rotary_pos_embedding.py``): :class:`CPUGPTModel` (a ``GPTModel``) builds a
  :class:`CPURotaryEmbedding`, which keeps it where it is, with the same arguments;
- the MoE router's gating (``router.py``: it moves the router's weight to CUDA on every call):
  :class:`CPUTopKRouter`, built in the layer spec's ``router`` slot.

Under pipeline parallelism with tied embeddings, ``CPUGPTModel`` also runs megatron's set-up of the
last stage's embedding copy under :class:`CudaOnCPU` (it calls ``.cuda()`` on it).

The default causal mask (``transformer.utils.get_default_causal_mask``, made on ``"cuda"`` when
the attention mask is None) is avoided through megatron's API: the CPU trainer passes an explicit
mask (:func:`causal_mask`).

What stays CUDA-only in megatron-core and so is not used on CPU: its ``DistributedDataParallel``
(gradient buffers on the current CUDA device), its optimizer and gradient clipping (``found_inf``
and norm tensors on ``"cuda"``), its no-pipelining schedule (``total_num_tokens`` on ``"cuda"``),
sequence parallelism (its all-gather buffer is the CUDA memory buffer), the MoE dispatchers' gathers
across EP ranks. The pipeline schedule runs (``miles_megatron.pipeline``: a communicator subclass
passed to it, :class:`CudaOnCPU` around it). The CPU trainer runs torch's AdamW with
megatron's weight-decay groups, the TP reduction of the q/k-norm gradients megatron's
``finalize_model_grads`` does (:func:`reduce_tp_shared_grads`) and of a tied embedding's two copies
under PP (:func:`reduce_tied_embedding_grads`), its own model-parallel gradient norm
(:func:`clip_grad_norm`) and the no-pipelining schedule's loop itself (``trainer.MegatronTrainer``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state  # type: ignore[import-untyped]
from megatron.core.models.common.embeddings.rotary_pos_embedding import (  # type: ignore[import-untyped]
    RotaryEmbedding,
)
from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped]
from megatron.core.tensor_parallel.layers import (  # type: ignore[import-untyped]
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.transformer.moe.router import TopKRouter  # type: ignore[import-untyped]
from torch.overrides import TorchFunctionMode


class CudaOnCPU(TorchFunctionMode):
    """While active, what megatron asks for on CUDA stays on the CPU: a factory call's ``device="cuda"``
    builds on the CPU and ``Tensor.cuda()`` returns the tensor where it is. Entered only around the
    megatron calls that hard-code CUDA on the CPU path: the pipeline schedule (its token counter) and
    the set-up of the tied embedding's copy on the last pipeline stage. Nothing else changes: a call
    that does not ask for CUDA passes through untouched."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


class CPURotaryEmbedding(RotaryEmbedding):
    """megatron's rotary embedding with its frequencies left on their (CPU) device."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


class CPUGPTModel(GPTModel):
    """megatron's GPT model whose rotary embedding computes on the CPU (:class:`CPURotaryEmbedding`).

    Takes ``GPTModel``'s arguments; the rotary ones are passed on to the CPU embedding as
    ``GPTModel`` passes them to its own.
    """

    def __init__(
        self,
        *args: Any,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000,
        seq_len_interpolation_factor: float | None = None,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            *args,
            rotary_percent=rotary_percent,
            rotary_base=rotary_base,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rope_scaling=rope_scaling,
            rope_scaling_factor=rope_scaling_factor,
            **kwargs,
        )
        if type(getattr(self, "rotary_pos_emb", None)) is RotaryEmbedding:
            self.rotary_pos_emb = CPURotaryEmbedding(
                kv_channels=self.config.kv_channels,
                rotary_percent=rotary_percent,
                rotary_interleaved=self.config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=True,
                cp_group=self.pg_collection.cp,
            )

    def setup_embeddings_and_output_layer(self) -> None:
        # Under PP with tied embeddings megatron keeps a copy of the embedding on the last stage and
        # synchronises it from the first with ``weight.data.cuda()`` then an all-reduce: on the CPU the
        # copy stays where it is and the all-reduce runs over gloo (megatron's own steps otherwise).
        with CudaOnCPU():
            super().setup_embeddings_and_output_layer()


class CPUTopKRouter(TopKRouter):
    """megatron's top-k router whose gating stays on the CPU.

    megatron-core 0.16's ``TopKRouter.gating`` moves the router's weight to ``torch.cuda.current_device()``
    when it finds it on the CPU, then calls ``router_gating_linear``, which without Transformer Engine
    fails on its missing ``te_general_gemm`` name. This one computes the same logits, the input times the
    router's weight in the routing dtype (``moe_router_dtype``), where the weight is; every other step
    of the router (top-k, scores, replay) is megatron's. Built in the MoE layer's ``router`` slot of the
    layer spec (``model_config.layer_spec``)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


def causal_mask(seq_len: int) -> torch.Tensor:
    """megatron's attention mask for causal rows of ``seq_len`` tokens ([1, 1, s, s], True: masked out)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def decays(name: str, p: torch.nn.Parameter) -> bool:
    """Whether megatron's optimizer applies weight decay to ``p``: not to biases and 1-D parameters."""
    return not (name.endswith(".bias") or p.dim() == 1)


def weight_decay_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Parameter groups as megatron's optimizer makes them: no decay for biases and 1-D parameters."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in named:
        if not p.requires_grad:
            continue
        (decay if decays(name, p) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def reduce_tp_shared_grads(model: torch.nn.Module, qk_layernorm: bool) -> None:
    """Sum over the TP group the gradients of replicated parameters that each TP rank only
    partly computes, as megatron's ``finalize_model_grads`` does with DDP: the q/k layer norms
    (shared by every head, and a TP rank holds a share of the heads), and average those marked
    ``average_gradients_across_tp_domain``."""
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if getattr(p, "average_gradients_across_tp_domain", False):
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dist.get_world_size(group))
        elif qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, group=group)


def reduce_tied_embedding_grads(model: Any) -> None:
    """Under PP with tied embeddings, sum the gradients of the embedding (first stage) and of its copy
    in the output layer (last stage) over megatron's embedding group, as its ``finalize_model_grads``
    does with DDP: both copies then take the same update and stay equal."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not model.share_embeddings_and_output_weights or not parallel_state.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float | None, grad_attr: str = "grad"
) -> float:
    """The gradient norm over the whole model-parallel group (each TP-duplicated parameter counted
    once, as megatron counts it), and the gradients scaled down to ``max_norm`` when it is above.

    ``grad_attr``: ``grad``, or ``main_grad`` where megatron's DDP accumulates (the streamed
    optimizer on CUDA); the sum is taken on the gradients' device (NCCL reduces CUDA tensors)."""
    present = [g for g in (getattr(p, grad_attr, None) for p in params) if g is not None]
    # The last pipeline stage's copy of a tied embedding (``shared``) is counted once, on the first stage.
    grads = [
        g
        for p in params
        if (g := getattr(p, grad_attr, None)) is not None
        and param_is_not_tensor_parallel_duplicate(p)
        and not getattr(p, "shared", False)
    ]
    device = present[0].device if present else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        squares += g.detach().double().pow(2).sum()
    group = parallel_state.get_model_parallel_group()  # TP x PP
    if dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    norm = math.sqrt(float(squares))
    if max_norm is not None and max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in present:
            g.mul_(scale)
    return norm
