"""REINFORCE++ advantages: discounted returns of KL-shaped token rewards, whitened over the batch.

Two estimators (Hu, "REINFORCE++", 2025):

- ``reinforce_pp``: token rewards ``r_t = −kl_coef·kl_t`` on the loss tokens, plus the
  sample's scalar reward at its last loss token; the advantage is the discounted return
  ``G_t = r_t + γ·G_{t+1}``.
- ``reinforce_pp_baseline``: the scalar reward minus its group's mean reward, on every loss
  token, minus ``kl_coef·kl_t``.

Both then whiten over all loss tokens of the batch (``normalize``, on by default).
``kl_t = kl_estimate(log π(x_t), log π_ref(x_t), kl_type)`` uses the policy's log-probs
recorded by the engine (``rollout_logprobs``) and the reference's from the trainer's scoring
pass (``token_scores["ref_logprobs"]``), which is only read when ``kl_coef > 0``.

The token-reward and option helpers here are shared with PPO (``gae.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from miles.builtins.algorithms.grpo import centered_rewards
from miles.builtins.algorithms.kl import KLType, check_kl_type, kl_estimate
from miles.builtins.algorithms.tokens import TokenBatch
from miles.builtins.algorithms.whiten import masked_mean_std, masked_whiten
from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.interfaces import REF_LOGPROBS, AdvantageOutput
from miles.types import Group

if TYPE_CHECKING:
    import torch


# ------------------------------------------------------------------ options


def check_unit_interval(value: object, name: str, who: str) -> float:
    """A discount-like option: a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{who}: {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_kl_coef(value: object, who: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ConfigError(
            f"{who}: kl_coef must be a finite number >= 0 (0 turns the KL penalty off), got {value!r}"
        )
    return float(value)


def check_flag(value: object, name: str, who: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{who}: {name} must be true or false, got {value!r}")
    return value


# ------------------------------------------------------------ token rewards


def kl_penalty(batch: TokenBatch, kl_coef: float, kl_type: KLType) -> tuple[torch.Tensor, dict[str, float]]:
    """``kl_coef·kl_t`` on the loss tokens, 0 elsewhere, and the metric ``advantages/ref_kl``.

    ``advantages/ref_kl`` is the mean of ``kl_t`` (before the coefficient) over the batch's
    loss tokens. With ``kl_coef == 0`` the penalty is all zeros and nothing is read, so no
    reference model is needed.
    """
    import torch

    if kl_coef == 0:
        return torch.zeros(batch.valid.shape, dtype=torch.float64), {}
    ref = batch.score(
        REF_LOGPROBS,
        why="kl_coef > 0 needs the reference policy's log-probs, filled by the trainer's scoring pass",
    )
    kl = torch.where(batch.mask, kl_estimate(batch.rollout_logprobs(), ref, kl_type), 0.0)
    mean_kl, _ = masked_mean_std(kl, batch.mask)
    return kl_coef * kl, {"advantages/ref_kl": mean_kl}


def terminal_rewards(batch: TokenBatch, rewards: list[float]) -> torch.Tensor:
    """Each sample's scalar reward at its last loss token, 0 everywhere else.

    The last *loss* token, not the last response token: in a multi-turn trajectory the
    response may end with an observation the policy did not write. A sample without any
    loss token has nowhere to put its reward and contributes nothing.
    """
    import torch

    out = torch.zeros(batch.valid.shape, dtype=torch.float64)
    if out.shape[1] == 0:
        return out
    positions = torch.arange(out.shape[1]).expand_as(batch.mask)
    last = torch.where(batch.mask, positions, -1).amax(dim=1)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = torch.tensor(rewards, dtype=torch.float64)[rows]
    return out


def discounted_returns(rewards: torch.Tensor, gamma: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``G_t = r_t + γ·G_{t+1}`` along the last dimension of ``rewards`` ([T] or [B, T]), with ``G_T = 0``.

    With ``mask``, the recurrence runs over the masked-in positions only, as if each row were
    compressed to them: ``t + 1`` means the next masked-in position, so ``γ`` applies once per
    trainable token and not across the observation spans between them. Masked-out positions
    get 0 and their rewards are ignored.
    """
    import torch

    keep = torch.ones_like(rewards, dtype=torch.bool) if mask is None else mask.bool()
    out = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[:-1])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        step = rewards[..., t] + gamma * running
        running = torch.where(keep[..., t], step, running)
        out[..., t] = torch.where(keep[..., t], step, 0.0)
    return out


def batch_rewards(groups: list[Group]) -> list[float]:
    """The scalar reward of every sample, in group order (a missing reward counts as 0)."""
    return [r for group in groups for r in group.rewards]


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``advantages/mean_raw`` and ``advantages/std_raw``: over the loss tokens, before whitening."""
    mean, std = masked_mean_std(advantages, mask)
    return {"advantages/mean_raw": mean, "advantages/std_raw": std}


# --------------------------------------------------------------- estimators


class ReinforcePPBaselineOptions(ComponentOptions):
    kl_coef: float = Field(
        0.0, description="weight of the per-token KL penalty against the reference model (0: off)"
    )
    kl_type: KLType = Field("k1", description="the KL estimator: k1, k2 or k3")
    normalize: bool = Field(True, description="whiten the advantages over all loss tokens of the batch")


class ReinforcePPOptions(ReinforcePPBaselineOptions):
    gamma: float = Field(1.0, description="discount per generated token, in [0, 1]")


class ReinforcePPAdvantage:
    """REINFORCE++: ``A_t = G_t = r_t + γ·G_{t+1}`` over the loss tokens, then whitened over the batch.

    ``r_t = −kl_coef·kl_t`` on every loss token, and the sample's scalar reward is added at
    its last loss token. The return runs over the loss tokens only (the response compressed
    to its trainable positions): ``G_{t+1}`` is the return at the next *loss* token, so
    ``γ`` discounts per generated token and an observation span between two turns costs no
    discount. (Upstream Miles discounts over the full response instead; with the default
    ``γ = 1`` the two agree.) ``G`` past the last loss token is 0.

    Options: ``gamma`` (1.0), ``kl_coef`` (0.0: no reference model needed), ``kl_type``
    (``k1``, ``k2`` or ``k3``; default ``k1``), ``normalize`` (true: whiten over all loss
    tokens of the batch, see ``whiten.masked_whiten``).

    Metrics: ``advantages/mean_raw``, ``advantages/std_raw`` (before whitening) and
    ``advantages/ref_kl`` (mean ``kl_t``) when ``kl_coef > 0``.
    """

    default_loss = "ppo_clip"
    Options = ReinforcePPOptions

    def __init__(
        self, gamma: float = 1.0, kl_coef: float = 0.0, kl_type: KLType = "k1", normalize: bool = True
    ) -> None:
        who = "reinforce_pp"
        self.gamma = check_unit_interval(gamma, "gamma", who)
        self.kl_coef = check_kl_coef(kl_coef, who)
        self.kl_type = check_kl_type(kl_type, who)
        self.normalize = check_flag(normalize, "normalize", who)
        self.requires: frozenset[str] = frozenset({REF_LOGPROBS}) if self.kl_coef else frozenset()

    def __call__(self, groups: list[Group]) -> AdvantageOutput:
        batch = TokenBatch.from_samples([s for g in groups for s in g.samples], who="reinforce_pp")
        penalty, metrics = kl_penalty(batch, self.kl_coef, self.kl_type)
        token_rewards = terminal_rewards(batch, batch_rewards(groups)) - penalty
        advantages = discounted_returns(token_rewards, self.gamma, batch.mask)
        metrics.update(advantage_metrics(advantages, batch.mask))
        if self.normalize:
            advantages = masked_whiten(advantages, batch.mask)
        return AdvantageOutput(advantages=batch.rows(advantages), metrics=metrics)


class ReinforcePPBaselineAdvantage:
    """REINFORCE++ with a group baseline: ``A_t = (r − mean of the group's rewards) − kl_coef·kl_t``.

    The centered reward is the same on every loss token of the sample; there is no
    discounting. A group whose rewards are all equal (or a group of one) has a centered
    reward of exactly 0. Then whitened over all loss tokens of the batch (``normalize``).

    Options: ``kl_coef`` (0.0), ``kl_type`` (``k1``), ``normalize`` (true).
    Metrics: as ``ReinforcePPAdvantage``.
    """

    default_loss = "ppo_clip"
    Options = ReinforcePPBaselineOptions

    def __init__(self, kl_coef: float = 0.0, kl_type: KLType = "k1", normalize: bool = True) -> None:
        who = "reinforce_pp_baseline"
        self.kl_coef = check_kl_coef(kl_coef, who)
        self.kl_type = check_kl_type(kl_type, who)
        self.normalize = check_flag(normalize, "normalize", who)
        self.requires: frozenset[str] = frozenset({REF_LOGPROBS}) if self.kl_coef else frozenset()

    def __call__(self, groups: list[Group]) -> AdvantageOutput:
        import torch

        batch = TokenBatch.from_samples([s for g in groups for s in g.samples], who="reinforce_pp_baseline")
        penalty, metrics = kl_penalty(batch, self.kl_coef, self.kl_type)
        centered = torch.tensor([c for g in groups for c in centered_rewards(g.rewards)], dtype=torch.float64)
        advantages = torch.where(batch.mask, centered.reshape(-1, 1), 0.0) - penalty
        metrics.update(advantage_metrics(advantages, batch.mask))
        if self.normalize:
            advantages = masked_whiten(advantages, batch.mask)
        return AdvantageOutput(advantages=batch.rows(advantages), metrics=metrics)
