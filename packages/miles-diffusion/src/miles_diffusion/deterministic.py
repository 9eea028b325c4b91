"""Deterministic mode: repeatable sampling, forward and backward on the same hardware."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# Attention processors known to run deterministically once deterministic algorithms are on. On CPU,
# scaled-dot-product attention runs the math kernel or torch's CPU flash-attention kernel, both
# repeatable at a fixed thread count; a processor outside this list (xformers, flash-attention
# wrappers, custom kernels) has no switch we can check, so it is refused. JointAttnProcessor2_0
# (SD3's joint image-text attention) is one scaled_dot_product_attention call over the joined
# sequence: repeatable on CPU (tests/diffusion/test_sd3.py replays a run bit for bit). On CUDA its
# kernels (flash, memory-efficient) are not checked here: the package runs on the CPU only.
# WanAttnProcessor (Wan's self- and cross-attention) calls diffusers' attention dispatcher, whose
# default backend is the same scaled_dot_product_attention (tests/diffusion/test_wan.py re-scores
# its log-probabilities bit for bit); a backend chosen through diffusers' attention-backend setting
# is not checked here. QwenDoubleStreamAttnProcessor2_0 (Qwen-Image's joint image-text attention)
# calls the same dispatcher (tests/diffusion/test_qwen_image.py re-scores bit for bit), as does
# LTXVideoAttnProcessor (LTX-Video's self- and cross-attention; tests/diffusion/test_ltx.py) and
# CosmosAttnProcessor2_0 (Cosmos-Predict2's; tests/diffusion/test_cosmos.py).
DETERMINISTIC_ATTENTION_PROCESSORS = frozenset(
    {
        "AttnProcessor",
        "AttnProcessor2_0",
        "JointAttnProcessor2_0",
        "WanAttnProcessor",
        "QwenDoubleStreamAttnProcessor2_0",
        "LTXVideoAttnProcessor",
        "CosmosAttnProcessor2_0",
    }
)

# transformers attention implementations (a text encoder's ``config._attn_implementation``) that
# compute with plain torch ops: the eager matmul-softmax path and scaled_dot_product_attention.
DETERMINISTIC_TEXT_ATTENTION = frozenset({"eager", "sdpa"})


def enable_deterministic_mode(seed: int) -> None:
    """Seed every RNG torch owns and make torch refuse nondeterministic kernels."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)


@contextmanager
def deterministic_mode(seed: int) -> Iterator[None]:
    """:func:`enable_deterministic_mode` for the duration of a block; the previous switch returns after."""
    before = torch.are_deterministic_algorithms_enabled()
    enable_deterministic_mode(seed)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def check_attention_backends(model: nn.Module) -> None:
    """Raise if any attention layer of ``model`` uses a processor that cannot be made deterministic:
    a diffusers attention processor outside the known list, or a transformers text encoder whose
    attention implementation is not ``eager`` / ``sdpa``. The frozen parts of a model family (its
    ``frozen_modules()``: text encoders, VAE) are checked too."""
    frozen = getattr(model, "frozen_modules", None)
    trees: list[tuple[str, nn.Module]] = [("", model)]
    if callable(frozen):
        trees += list(frozen().items())
    for prefix, tree in trees:
        _check_tree(prefix, tree)


def _check_tree(prefix: str, tree: nn.Module) -> None:
    config = getattr(tree, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if isinstance(implementation, str) and implementation not in DETERMINISTIC_TEXT_ATTENTION:
        raise ValueError(
            f"deterministic mode: {prefix or type(tree).__name__!r} uses the {implementation!r} attention "
            f"implementation, which has no deterministic mode; use one of {sorted(DETERMINISTIC_TEXT_ATTENTION)}"
        )
    for inner, module in tree.named_modules():
        name = ".".join(part for part in (prefix, inner) if part)
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        kind = type(processor).__name__
        if kind not in DETERMINISTIC_ATTENTION_PROCESSORS:
            raise ValueError(
                f"deterministic mode: attention {name!r} uses {kind}, which has no deterministic "
                f"mode; use one of {sorted(DETERMINISTIC_ATTENTION_PROCESSORS)}"
            )
