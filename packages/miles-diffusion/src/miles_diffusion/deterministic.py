"""Deterministic mode: repeatable sampling, forward and backward on the same hardware."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# Attention processors known to run deterministically once deterministic algorithms are on. On CPU,
# scaled-dot-product attention runs the math kernel; a processor outside this list (xformers,
# flash-attention wrappers, custom kernels) has no switch we can check, so it is refused.
DETERMINISTIC_ATTENTION_PROCESSORS = frozenset({"AttnProcessor", "AttnProcessor2_0"})


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
    """Raise if any attention layer of ``model`` uses a processor that cannot be made deterministic."""
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None:
            continue
        kind = type(processor).__name__
        if kind not in DETERMINISTIC_ATTENTION_PROCESSORS:
            raise ValueError(
                f"deterministic mode: attention {name!r} uses {kind}, which has no deterministic "
                f"mode; use one of {sorted(DETERMINISTIC_ATTENTION_PROCESSORS)}"
            )
