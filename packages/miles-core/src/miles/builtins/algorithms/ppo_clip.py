"""Clipped policy-gradient losses: PPO's per-token ratio and GSPO's sequence-level ratio.

Both share one body (``PPOClipLoss.__call__``); they differ only in the importance ratio each
token's policy-gradient term uses (``_policy_log_ratio``) and in their defaults.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from miles.builtins.algorithms.kl import KLType, check_kl_type, kl_estimate
from miles.builtins.algorithms.reduction import Reduction, check_reduction, masked_mean, masked_reduce
from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.interfaces import LossInputs, LossOutput

if TYPE_CHECKING:
    import torch

# exp(20) is about 5e8: far beyond any clip bound, and finite in every float type we train in.
LOG_RATIO_LIMIT = 20.0


def _number(value: object, who: str, name: str) -> float:
    """A finite real option value, or one ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{who}: {name} must be a finite number, got {value!r}")
    return float(value)


class PPOClipOptions(ComponentOptions):
    clip_low: float = Field(0.2, description="the ratio is clipped below at 1 - clip_low, in [0, 1)")
    clip_high: float = Field(0.28, description="the ratio is clipped above at 1 + clip_high (>= 0)")
    dual_clip: float | None = Field(
        None, description="dual-clip bound c > 1 for negative advantages (null: off)"
    )
    kl_coef: float = Field(0.0, description="weight of the KL term against the reference model (0: off)")
    kl_type: KLType = Field("k2", description="the KL estimator: k1, k2 or k3")
    entropy_coef: float = Field(0.0, description="weight of the entropy bonus (0: off)")
    reduction: Reduction = Field("token_mean", description="token_mean or sample_mean (see docs/losses.md)")


class GSPOOptions(PPOClipOptions):
    clip_low: float = Field(3e-4, description="the sequence ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(4e-4, description="the sequence ratio is clipped above at 1 + clip_high")
    reduction: Reduction = Field("sample_mean", description="sample_mean (the paper's 1/|y|) or token_mean")


class PPOClipLoss:
    """PPO's clipped surrogate, per token, with optional KL and entropy terms.

    With ``r_t = exp(logp_t − old_logp_t)`` (log-ratio clamped to ±20) and advantage ``A_t``::

        pg_t   = max(−r_t·A_t, −clip(r_t, 1 − clip_low, 1 + clip_high)·A_t)
        pg_t   = min(pg_t, −dual_clip·A_t)        where A_t < 0, if dual_clip is set
        loss   = reduce(w_t·pg_t) + kl_coef·reduce(kl_t) − entropy_coef·reduce(H_t)

    ``w_t`` are the correction weights (TIS, clip-or-pop; 1 without a correction): they
    scale the policy-gradient term only. ``kl_t = kl_estimate(logp_t, ref_logp_t, kl_type)``
    against the frozen reference policy and ``H_t`` is the policy's entropy at that position
    (it carries a gradient, so the bonus pushes entropy up). ``reduce`` is
    ``masked_reduce(·, loss_mask, inputs, reduction)``: ``token_mean`` (default: micro-batch
    losses add up to the mean over the global batch's loss tokens) or ``sample_mean`` (each
    sample weighs the same whatever its length).

    ``kl_type`` defaults to ``k2`` because as a loss term its on-policy gradient is exactly
    that of the reverse KL(π ‖ π_ref) the penalty stands for; ``k1``'s gradient is zero in
    expectation (only noise), and ``k3``'s (GRPO's) is that of the forward KL(π_ref ‖ π).

    Metrics, masked means over this micro-batch's loss tokens whatever the reduction:
    ``pg_loss`` (``w_t·pg_t``), ``clipfrac`` (tokens where the clipped term won),
    ``approx_kl`` (``r − 1 − log r`` of the per-token ratio: a k3 estimate of
    KL(old ‖ current)), ``dual_clipfrac`` when dual clip is on, ``kl_loss`` (``kl_t``) when
    ``kl_coef`` > 0 and ``entropy`` (``H_t``) when ``entropy_coef`` > 0.
    """

    kind = "policy"
    name = "ppo_clip"

    Options = PPOClipOptions

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dual_clip: float | None = None,
        kl_coef: float = 0.0,
        kl_type: KLType = "k2",
        entropy_coef: float = 0.0,
        reduction: Reduction = "token_mean",
    ) -> None:
        who = self.name
        self.clip_low = _number(clip_low, who, "clip_low")
        self.clip_high = _number(clip_high, who, "clip_high")
        if not 0 <= self.clip_low < 1:
            raise ConfigError(f"{who}: clip_low must be in [0, 1), got {clip_low!r}")
        if not self.clip_high >= 0:
            raise ConfigError(f"{who}: clip_high must be >= 0, got {clip_high!r}")
        if dual_clip is not None and not _number(dual_clip, who, "dual_clip") > 1:
            raise ConfigError(f"{who}: dual_clip must be > 1 (or null to disable), got {dual_clip!r}")
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        self.kl_coef = _number(kl_coef, who, "kl_coef")
        self.entropy_coef = _number(entropy_coef, who, "entropy_coef")
        for name, value in (("kl_coef", self.kl_coef), ("entropy_coef", self.entropy_coef)):
            if value < 0:
                raise ConfigError(f"{who}: {name} must be >= 0 (0 turns the term off), got {value!r}")
        self.kl_type = check_kl_type(kl_type, who)
        self.reduction = check_reduction(reduction, who)
        # The optional inputs the trainer must compute for this configuration.
        self.requires: frozenset[str] = frozenset(
            name
            for name, on in (("ref_logprobs", self.kl_coef > 0), ("entropy", self.entropy_coef > 0))
            if on
        )

    def _policy_log_ratio(
        self, logprobs: torch.Tensor, token_log_ratio: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The log importance ratio each token's policy-gradient term uses: PPO's per-token one."""
        return token_log_ratio

    def __call__(self, inputs: LossInputs) -> LossOutput:
        import torch

        who = self.name
        inputs.need("logprobs", "old_logprobs", "advantages", *sorted(self.requires), who=who)
        # need() checked them:
        assert inputs.logprobs is not None and inputs.old_logprobs is not None
        assert inputs.advantages is not None
        shape = inputs.logprobs.shape
        read = ("old_logprobs", "advantages", "loss_mask", "correction_weights", *sorted(self.requires))
        for name in read:
            tensor = getattr(inputs, name)
            if tensor is not None and tensor.shape != shape:
                raise ValueError(f"{who}: {name} has shape {tuple(tensor.shape)}, logprobs {tuple(shape)}")

        dtype = torch.promote_types(inputs.logprobs.dtype, torch.float32)
        mask = inputs.loss_mask.to(dtype)
        keep = mask > 0
        zeros = torch.zeros_like(mask)

        def loss_tokens_only(tensor: torch.Tensor) -> torch.Tensor:
            # Padding may hold anything (even inf or nan): replace it before it enters the
            # graph, since 0·nan is nan and a masked nan would poison the loss and gradient.
            return torch.where(keep, tensor.to(dtype), zeros)

        logprobs = loss_tokens_only(inputs.logprobs)
        old_logprobs = loss_tokens_only(inputs.old_logprobs.detach())
        adv = loss_tokens_only(inputs.advantages.detach())

        # An infinite log-ratio saturates at the limit, −inf − −inf counts as 0; where the clamp
        # is active the gradient is 0 (the clip would stop it anyway).
        token_log_ratio = torch.nan_to_num(
            logprobs - old_logprobs, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT
        ).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        ratio = torch.exp(self._policy_log_ratio(logprobs, token_log_ratio, mask))

        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        pg = torch.maximum(unclipped, clipped)
        dual_active = None
        if self.dual_clip is not None:
            bound = -adv * self.dual_clip
            dual_active = (adv < 0) & (pg > bound)
            pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
        if inputs.correction_weights is not None:
            pg = pg * loss_tokens_only(inputs.correction_weights.detach())
        loss = masked_reduce(pg, mask, inputs, self.reduction)

        metrics = {
            "pg_loss": masked_mean(pg, mask),
            "clipfrac": masked_mean(clipped > unclipped, mask),
            "approx_kl": masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask),
        }
        if dual_active is not None:
            metrics["dual_clipfrac"] = masked_mean(dual_active, mask)
        if self.kl_coef > 0:
            assert inputs.ref_logprobs is not None  # in self.requires, so need() checked it
            kl = kl_estimate(logprobs, loss_tokens_only(inputs.ref_logprobs.detach()), self.kl_type)
            loss = loss + self.kl_coef * masked_reduce(kl, mask, inputs, self.reduction)
            metrics["kl_loss"] = masked_mean(kl, mask)
        if self.entropy_coef > 0:
            assert inputs.entropy is not None  # in self.requires, so need() checked it
            entropy = loss_tokens_only(inputs.entropy)
            loss = loss - self.entropy_coef * masked_reduce(entropy, mask, inputs, self.reduction)
            metrics["entropy"] = masked_mean(entropy, mask)
        return LossOutput(loss=loss, metrics=metrics)


class GSPOLoss(PPOClipLoss):
    """GSPO (Zheng et al., 2025): PPO's clipped surrogate on a sequence-level importance ratio.

    Sample i's ratio is the geometric mean of its tokens' ratios over its loss tokens,
    ``s_i = exp(mean_t (logp_it − old_logp_it))``, so one outlier token cannot swing it the
    way it swings a per-token ratio. It is applied per token in the "GSPO-token" form
    ``r_it = sg(s_i)·exp(logp_it − sg(logp_it))``: its value is ``s_i`` and its gradient
    ``s_i·∇logp_it``, which lets advantages vary per token (for GRPO they are the sample's
    one value on every token) while matching sequence-level GSPO when they do not.
    Clipping, dual clip, correction weights, KL and entropy terms work as in
    :class:`PPOClipLoss`.

    Defaults differ from PPO's: ``clip_low = 3e-4``, ``clip_high = 4e-4`` (the paper's bounds:
    a length-normalized ratio moves far less than a token's), and ``reduction =
    "sample_mean"``, which is the paper's ``1/|y_i|`` normalization: for an unclipped token
    the gradient is ``−s_i·A_it·∇logp_it / (|y_i|·num_samples)``, i.e. every sample weighs
    the same. ``token_mean`` instead weighs each sample by its length.
    """

    name = "gspo"
    Options = GSPOOptions

    def __init__(
        self,
        clip_low: float = 3e-4,
        clip_high: float = 4e-4,
        dual_clip: float | None = None,
        kl_coef: float = 0.0,
        kl_type: KLType = "k2",
        entropy_coef: float = 0.0,
        reduction: Reduction = "sample_mean",
    ) -> None:
        super().__init__(
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual_clip,
            kl_coef=kl_coef,
            kl_type=kl_type,
            entropy_coef=entropy_coef,
            reduction=reduction,
        )

    def _policy_log_ratio(
        self, logprobs: torch.Tensor, token_log_ratio: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        import torch

        # log s_i: the masked mean of the (already clamped) token log-ratios of row i, held fixed.
        log_s = (token_log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        # Value 0, gradient 1 w.r.t. logp_it (0 where logp is infinite: nan_to_num stops it).
        carrier = torch.nan_to_num(logprobs - logprobs.detach(), nan=0.0)
        return log_s.detach() + carrier
