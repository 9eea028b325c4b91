"""Supervised fine-tuning: the negative log-likelihood of the target tokens."""

from __future__ import annotations

import math

from pydantic import Field

from miles.builtins.algorithms.reduction import Reduction, check_reduction, masked_mean, masked_reduce
from miles.capabilities import ComponentOptions
from miles.interfaces import LossInputs, LossOutput

# Above this NLL the reported perplexity stops growing: e^80 ≈ 5.5e34 already says "untrained",
# and the cap keeps the metric a finite float.
PPL_LOG_CAP = 80.0


class SFTOptions(ComponentOptions):
    reduction: Reduction = Field("token_mean", description="token_mean or sample_mean (see docs/losses.md)")


class SFTLoss:
    """``reduce(−logp_t)`` over the loss tokens (for chat data: the assistant's tokens).

    ``reduction`` is ``token_mean`` (default: micro-batch losses add up to the mean NLL per
    target token of the global batch) or ``sample_mean`` (each example weighs the same
    whatever its length); see :func:`~miles.builtins.algorithms.reduction.masked_reduce`.

    Metrics over this micro-batch's loss tokens: ``nll`` (masked mean of ``−logp``) and
    ``ppl = exp(nll)`` (capped at ``e^80``). The trainer averages micro-batch metrics
    weighted by their token counts, so the step's ``ppl`` is a token-weighted mean of the
    micro-batch perplexities, which is >= ``exp`` of the step's ``nll``; read ``nll``
    when the two disagree.
    """

    kind = "supervised"
    name = "sft"
    Options = SFTOptions

    def __init__(self, reduction: Reduction = "token_mean") -> None:
        self.reduction = check_reduction(reduction, self.name)
        self.requires: frozenset[str] = frozenset()

    def __call__(self, inputs: LossInputs) -> LossOutput:
        import torch

        inputs.need("logprobs", who=self.name)
        assert inputs.logprobs is not None  # need() checked it
        if inputs.loss_mask.shape != inputs.logprobs.shape:
            raise ValueError(
                f"{self.name}: loss_mask has shape {tuple(inputs.loss_mask.shape)}, "
                f"logprobs {tuple(inputs.logprobs.shape)}"
            )
        dtype = torch.promote_types(inputs.logprobs.dtype, torch.float32)
        mask = inputs.loss_mask.to(dtype)
        # Padding may hold anything: replace it before it enters the graph (0·nan is nan).
        nll = torch.where(mask > 0, -inputs.logprobs.to(dtype), torch.zeros_like(mask))
        loss = masked_reduce(nll, mask, inputs, self.reduction)
        mean_nll = masked_mean(nll, mask)
        return LossOutput(loss=loss, metrics={"nll": mean_nll, "ppl": math.exp(min(mean_nll, PPL_LOG_CAP))})
