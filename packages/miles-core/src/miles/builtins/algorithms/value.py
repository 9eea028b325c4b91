"""PPO's clipped value loss, trained on the critic (``algorithm.critic.loss_options``)."""

from __future__ import annotations

import math

from pydantic import Field

from miles.builtins.algorithms.reduction import Reduction, check_reduction, masked_mean, masked_reduce
from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.interfaces import LossInputs, LossOutput


class ValueClipOptions(ComponentOptions):
    clip: float | None = Field(
        0.2, description="how far a step may move a prediction from V_old (> 0; null: plain squared error)"
    )
    reduction: Reduction = Field("token_mean", description="token_mean or sample_mean")


class ClippedValueLoss:
    """``½·max((V − R)², (clip(V, V_old − c, V_old + c) − R)²)`` per token, reduced.

    ``V`` are the critic's current predictions (with gradient), ``V_old`` its predictions
    from the scoring pass that computed the advantages, ``R`` the returns (targets). The
    clipped branch keeps one step from moving a prediction more than ``c`` away from
    ``V_old`` in the direction that would lower the loss; taking the max makes the
    objective pessimistic, as PPO's policy clip does. ``clip = None`` gives plain ``½(V − R)²``.

    The ½ makes the per-token gradient the residual ``V − R`` (on the unclipped branch), so
    the critic's learning rate reads in the units of the returns. Reduction as in
    :func:`~miles.builtins.algorithms.reduction.masked_reduce` (``token_mean`` default).

    Metrics, masked means over this micro-batch's loss tokens: ``value_loss`` (the per-token
    loss above), ``value_clipfrac`` (tokens where the clipped branch is strictly larger, i.e.
    the clip is what sets the loss), ``values_mean`` (``V``) and ``returns_mean`` (``R``).
    """

    kind = "value"
    name = "value_clip"
    Options = ValueClipOptions

    def __init__(self, clip: float | None = 0.2, reduction: Reduction = "token_mean") -> None:
        if clip is not None and (
            isinstance(clip, bool)
            or not isinstance(clip, int | float)
            or not (math.isfinite(clip) and clip > 0)
        ):
            raise ConfigError(f"{self.name}: clip must be a number > 0 (or null to disable), got {clip!r}")
        self.clip = None if clip is None else float(clip)
        self.reduction = check_reduction(reduction, self.name)
        self.requires: frozenset[str] = frozenset()  # values, old_values and returns come with the kind

    def __call__(self, inputs: LossInputs) -> LossOutput:
        import torch

        who = self.name
        inputs.need("values", "old_values", "returns", who=who)
        # need() checked them:
        assert inputs.values is not None and inputs.old_values is not None and inputs.returns is not None
        shape = inputs.values.shape
        for name in ("old_values", "returns", "loss_mask"):
            tensor = getattr(inputs, name)
            if tensor.shape != shape:
                raise ValueError(f"{who}: {name} has shape {tuple(tensor.shape)}, values {tuple(shape)}")

        dtype = torch.promote_types(inputs.values.dtype, torch.float32)
        mask = inputs.loss_mask.to(dtype)
        keep = mask > 0
        zeros = torch.zeros_like(mask)
        # Padding may hold anything: replace it before it enters the graph (0·nan is nan).
        values = torch.where(keep, inputs.values.to(dtype), zeros)
        old_values = torch.where(keep, inputs.old_values.detach().to(dtype), zeros)
        returns = torch.where(keep, inputs.returns.detach().to(dtype), zeros)

        unclipped = (values - returns).square()
        if self.clip is None:
            per_token = 0.5 * unclipped
            clipped_wins = torch.zeros_like(keep)
        else:
            moved = values.clamp(old_values - self.clip, old_values + self.clip)
            clipped = (moved - returns).square()
            per_token = 0.5 * torch.maximum(unclipped, clipped)
            clipped_wins = clipped > unclipped
        loss = masked_reduce(per_token, mask, inputs, self.reduction)
        metrics = {
            "value_loss": masked_mean(per_token, mask),
            "value_clipfrac": masked_mean(clipped_wins, mask),
            "values_mean": masked_mean(values, mask),
            "returns_mean": masked_mean(returns, mask),
        }
        return LossOutput(loss=loss, metrics=metrics)
