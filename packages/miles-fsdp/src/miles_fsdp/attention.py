"""Attention for packed micro-batches that reads the samples' boundaries instead of a mask.

A packed micro-batch is one ``[1, T]`` row of samples laid end to end. transformers' own backends
keep the samples apart with a block-diagonal mask built from the position ids; with SDPA an explicit
mask leaves the causal flash kernel for the memory-efficient one and holds a ``T x T`` mask, which
halved training throughput on an H200 (docs/benchmarks.md, section 11).

``miles_varlen`` is registered with transformers' ``AttentionInterface`` (its extension point for
attention backends; nothing of transformers is patched). The rank passes the boundaries as the
keyword arguments transformers defines for variable-length flash attention (``cu_seq_lens_q``,
``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``); models that support attention backends
forward them to the attention call, and ``check_model`` refuses the ones that do not. Then:

* on CUDA, half precision: torch's variable-length flash kernel
  (``torch.nn.attention.varlen.varlen_attn``), one launch for every sample of the row;
* elsewhere (the CPU, float32): one causal SDPA call per sample, the same values computed plainly.

Without boundaries (a padded batch, the one-token idle pass) it is causal SDPA over each row,
which is what the padded path computes with no attention mask.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from miles.errors import ModelError

NAME = "miles_varlen"


def segment_kwargs(lengths: list[int], device: torch.device | str) -> dict[str, Any]:
    """The boundary keyword arguments for a packed row of samples of these lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    offsets = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max(lengths)
    return {
        "cu_seq_lens_q": offsets,
        "cu_seq_lens_k": offsets,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def _find_varlen_kernel() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """torch's variable-length flash attention and the keyword arguments this torch's version takes."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


# Looked up once at import, not per call: under fsdp.compile the attention call is traced, and a
# plain module constant keeps the import and signature inspection out of the traced code.
_VARLEN_KERNEL = _find_varlen_kernel()


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float | None
) -> torch.Tensor | None:
    """``[T, H, D]`` through the flash kernel, or None where it cannot run (CPU, float32, old torch)."""
    kernel = _VARLEN_KERNEL
    if kernel is None or not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    fn, params = kernel
    kwargs: dict[str, Any] = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return None  # this torch's kernel takes only the default 1/sqrt(head_dim) scale
    # torch's signature moved between releases: causality as ``is_causal`` or as a (left, right)
    # window; grouped-query attention as a flag or not at all (then the KV heads are repeated).
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = fn(q, k, v, cu, cu, longest, longest, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _per_segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``[T, H, D]``: causal SDPA over each sample on its own."""
    outs = []
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=qs.shape[0] != ks.shape[0]
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-backend signature: ``[B, H, L, D]`` in, ``[B, L, H, D]`` out."""
    if dropout:
        raise ModelError(f"fsdp: {NAME} attention has no dropout (the model asked for {dropout})")
    if kwargs.get("sliding_window"):
        raise ModelError(f"fsdp: {NAME} attention has no sliding window; this layer uses one")
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        if attention_mask is not None:
            raise ModelError(f"fsdp: {NAME} attention takes sample boundaries, not an attention mask")
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    if query.shape[0] != 1:
        raise ModelError(f"fsdp: {NAME} attention with sample boundaries takes one packed row")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    flat = _flash_varlen(q, k, v, cu, int(kwargs["max_length_q"]), scaling)
    if flat is None:
        flat = _per_segment(q, k, v, cu, scaling)
    return flat.unsqueeze(0), None


def register() -> None:
    """Make ``attn_implementation="miles_varlen"`` loadable (idempotent; ranks call it before loading)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)


def check_model(model: nn.Module, role: str) -> None:
    """Refuse a model whose forward would not hand the sample boundaries to its attention layers."""
    supports = getattr(type(model), "_supports_attention_backend", False)
    if not supports:
        raise ModelError(
            f"fsdp: the {role} ({type(model).__name__}) does not pass attention keyword arguments through "
            f"its layers, so packed training cannot keep its samples apart with {NAME}; set "
            "fsdp.attn_implementation (e.g. sdpa: a mask from the position ids) or unset "
            "fsdp.max_tokens_per_gpu"
        )
