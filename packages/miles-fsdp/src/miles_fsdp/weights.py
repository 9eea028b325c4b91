"""The model's full tensors under Hugging Face names, in a stable order, gathered from FSDP shards."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Prefixes that wrappers (torch.compile, activation checkpointing, FSDP1) insert into
# parameter names. FSDP2 itself keeps the module tree, so HF names normally come out as is.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def is_expert(name: str) -> bool:
    """Mixture-of-experts weights (``...mlp.experts...``) go in the second pass of a weight update."""
    return ".experts." in name


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)``: non-expert parameters, persistent buffers, then expert parameters.

    A collective: every rank must drain the iterator in the same order. Tied
    parameters (e.g. embeddings shared with the LM head) come once, under the first
    name; engines tie them the same way when they load the model. Experts come last
    so a transport can bucket them in a pass of their own.
    """
    persistent = set(model.state_dict(keep_vars=True).keys())
    params = [(hf_name(n), p) for n, p in model.named_parameters()]
    for name, param in params:
        if not is_expert(name):
            yield name, _full(param)
    for name, buf in model.named_buffers():
        if name in persistent:
            yield hf_name(name), _full(buf)
    for name, param in params:
        if is_expert(name):
            yield name, _full(param)


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t
