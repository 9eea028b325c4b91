"""Whitening over every loss token of the batch at once (not per sample, not per group)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Added to the variance before the square root: a batch whose loss tokens all carry the same
# advantage whitens to zeros instead of dividing 0 by 0.
WHITEN_EPS = 1e-8


def masked_mean_std(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and standard deviation of ``values`` over the positions where ``mask`` is true.

    The standard deviation is the sample one (``n − 1`` in the denominator, Bessel's
    correction) when ``n >= 2``, and 0 when ``n <= 1``; with ``n = 0`` the mean is 0 too.
    """
    mean, var = _masked_mean_var(values, mask)
    return mean, var**0.5


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """``(A − μ) / sqrt(var + eps)`` on the positions where ``mask`` is true, 0 elsewhere.

    ``μ`` and ``var`` are taken over every masked-in position of the whole tensor (the batch's
    loss tokens), ``var`` with Bessel's correction (``Σ (A − μ)² / (n − 1)``) when ``n >= 2``.
    Edge cases: ``n = 1`` uses ``var = 0``, so its one token becomes ``0 / sqrt(eps) = 0``
    (a single token carries no signal relative to itself); ``n = 0`` returns all zeros.
    A batch whose loss tokens are all equal also whitens to zeros, never to nan.
    """
    import torch

    mask = mask.bool()
    mean, var = _masked_mean_var(values, mask)
    whitened = (values - mean) / (var + eps) ** 0.5
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def _masked_mean_var(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    picked = values[mask.bool()].double()
    n = picked.numel()
    if n == 0:
        return 0.0, 0.0
    mean = float(picked.mean())
    var = float(((picked - mean) ** 2).sum()) / (n - 1) if n >= 2 else 0.0
    return mean, var
