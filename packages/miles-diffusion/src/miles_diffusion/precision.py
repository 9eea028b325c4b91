"""Per-parameter dtype control: compute in BF16 while named precision-sensitive modules stay FP32.

Diffusion RL compares the engine's and the trainer's forward passes, and a few small modules carry
most of the rounding risk: the timestep embedder (a sinusoidal embedding of ``t * 1000`` through an
MLP, whose output moves little between neighbouring steps) and the modulation / conditioning tables.
:class:`PrecisionConfig` names them by module path (``fnmatch`` patterns, e.g.
``unet.time_embedding`` or ``unet.*.time_emb_proj``); :func:`apply_precision` runs the model's
forward under autocast at ``compute_dtype`` and those modules outside it, in FP32, on FP32 inputs.

The parameters themselves stay FP32 (they are the optimizer's master weights); autocast casts them
for the BF16 matmuls and convolutions, as FSDP2's mixed-precision policy casts the gathered
parameters. This is the single-process form of that policy; under FSDP2 (:mod:`miles_diffusion.fsdp`)
the same section maps onto ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class PrecisionConfig:
    compute_dtype: str = "float32"
    """The dtype of the forward pass outside the FP32 modules: float32 (autocast off), bfloat16, float16."""
    fp32_modules: tuple[str, ...] = ()
    """Module paths (``fnmatch`` patterns over ``named_modules`` names) computed in FP32; each pattern
    must match at least one module."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype must be one of {sorted(DTYPES)}, got {self.compute_dtype!r}")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.compute_dtype]


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, tuple | list):
        return type(value)(_to_fp32(v) for v in value)
    return value


def _fp32_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, outside autocast, on FP32 inputs (bound to each kept module)."""
    original: Callable[..., Any] = type(self).forward
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    with torch.autocast(device_type=device, enabled=False):
        return original(self, *_to_fp32(args), **{k: _to_fp32(v) for k, v in kwargs.items()})


def keep_fp32(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Make the modules of ``model`` matching ``patterns`` compute in FP32 under autocast; returns
    their names. A pattern that matches nothing is refused (a typo would silently keep nothing)."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ValueError(f"fp32_modules: {pattern!r} matches no module of {type(model).__name__}")
    kept: list[str] = []
    for name, module in model.named_modules():
        if name and any(fnmatchcase(name, p) for p in patterns):
            # An instance attribute, bound to the module: deepcopy (a frozen reference) rebinds it.
            module.forward = types.MethodType(_fp32_forward, module)
            kept.append(name)
    return kept
