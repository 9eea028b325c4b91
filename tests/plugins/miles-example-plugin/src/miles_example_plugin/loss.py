"""Plain REINFORCE, as a ``miles.interfaces.Loss``.

Imports torch at the top on purpose: this module is imported only when a recipe
selects ``algorithm.loss: reinforce``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.interfaces import LossInputs, LossOutput


class ReinforceOptions(ComponentOptions):
    """``algorithm.loss_options`` of ``reinforce``: validated by Miles before the run starts."""

    scale: float = Field(1.0, gt=0, description="multiplies the loss (> 0)")


class ReinforceLoss:
    """Minimise ``-A * log pi(token)`` over the trained tokens (no ratio, no clipping).

    Each token's term is weighted by ``loss_mask`` and, when a correction is
    configured, by its ``correction_weights`` (e.g. truncated importance sampling).
    The sum is divided by ``num_loss_tokens``, the trained-token count of the whole
    global batch, so micro-batches add up to a token mean, and multiplied by the ``scale``
    option (its options model, ``ReinforceOptions``, is how Miles validates and lists it).
    """

    Options = ReinforceOptions

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, inputs: LossInputs) -> LossOutput:
        weights = inputs.loss_mask.to(inputs.logprobs.dtype)
        if inputs.correction_weights is not None:
            weights = weights * inputs.correction_weights.detach()
        per_token = -inputs.advantages.detach() * inputs.logprobs * weights
        loss = self.scale * per_token.sum() / max(int(inputs.num_loss_tokens), 1)
        with torch.no_grad():
            trained = inputs.loss_mask.sum().clamp(min=1)
            mean_logprob = (inputs.logprobs * inputs.loss_mask).sum() / trained
        return LossOutput(loss=loss, metrics={"pg_loss": loss.item(), "logprob_mean": mean_logprob.item()})
