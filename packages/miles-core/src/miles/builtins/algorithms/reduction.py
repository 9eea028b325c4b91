"""How a loss turns per-token values into the one scalar a micro-batch backpropagates.

The trainer splits a global batch into micro-batches and sums their losses' gradients, so a
reduction must divide by a count of the *global* batch (``LossInputs.num_loss_tokens`` or
``LossInputs.num_samples``), never by a count of the micro-batch: then the micro-batch losses
add up to the same number whatever the split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from miles.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from miles.interfaces import LossInputs

Reduction = Literal["token_mean", "sample_mean"]
REDUCTIONS: tuple[str, ...] = ("token_mean", "sample_mean")


def check_reduction(mode: object, who: str) -> Reduction:
    """Validate a recipe's ``reduction`` option at construction time (``who`` names the component)."""
    if mode not in REDUCTIONS:
        raise ConfigError(f"{who}: reduction must be one of {', '.join(REDUCTIONS)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def masked_reduce(
    per_token: torch.Tensor, mask: torch.Tensor, inputs: LossInputs, mode: Reduction
) -> torch.Tensor:
    """Reduce ``per_token`` ([batch, len]) over the tokens where ``mask`` > 0.

    ``token_mean``:  ``Σ_i Σ_t x_it·m_it / N`` with N = ``inputs.num_loss_tokens`` (global).
        Every loss token weighs the same, so a long sample counts more than a short one.
    ``sample_mean``: ``Σ_i [Σ_t x_it·m_it / max(n_i, 1)] / S`` with n_i = ``Σ_t m_it`` (row i's
        loss tokens) and S = ``inputs.num_samples`` (global). Every sample weighs the same
        whatever its length; a row with no loss tokens contributes 0.

    Both need each row to be one whole sample (the trainer guarantees it). Values under
    mask 0 are replaced, not multiplied, so padding holding inf or nan neither reaches the
    result nor poisons the gradient.
    """
    import torch

    if per_token.shape != mask.shape:
        raise ValueError(
            f"masked_reduce: per_token has shape {tuple(per_token.shape)}, mask {tuple(mask.shape)}"
        )
    mask = mask.to(per_token.dtype)
    weighted = torch.where(mask > 0, per_token * mask, torch.zeros_like(per_token))
    if mode == "token_mean":
        return weighted.sum() / max(int(inputs.num_loss_tokens), 1)
    if mode == "sample_mean":
        row_means = weighted.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return row_means.sum() / max(int(inputs.num_samples), 1)
    raise ValueError(f"masked_reduce: mode must be one of {', '.join(REDUCTIONS)}, got {mode!r}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """``Σ x·m / Σ m`` over this micro-batch (0 when it has no loss tokens), detached, for metrics.

    The trainer combines micro-batch metrics weighted by their loss-token counts, which
    turns these into token means over the global batch.
    """
    import torch

    with torch.no_grad():
        mask = mask.double()
        values = torch.where(mask > 0, values.detach().double() * mask, torch.zeros_like(mask))
        return float(values.sum() / mask.sum().clamp(min=1.0))
