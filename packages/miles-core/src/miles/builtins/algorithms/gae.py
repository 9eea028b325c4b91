"""PPO advantages: generalized advantage estimation (GAE) with a learned value function.

The token rewards are REINFORCE++'s (``reinforce_pp.py``): ``−kl_coef·kl_t`` on every loss
token plus the scalar reward at the last loss token. The critic's predictions ``V_t`` come
from ``token_scores["values"]`` (the trainer's scoring pass), and the critic is trained
towards ``returns = A + V``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from miles.builtins.algorithms.kl import KLType, check_kl_type
from miles.builtins.algorithms.reinforce_pp import (
    ReinforcePPOptions,
    advantage_metrics,
    batch_rewards,
    check_flag,
    check_kl_coef,
    check_unit_interval,
    kl_penalty,
    terminal_rewards,
)
from miles.builtins.algorithms.tokens import TokenBatch
from miles.builtins.algorithms.whiten import masked_mean_std, masked_whiten
from miles.interfaces import REF_LOGPROBS, VALUES, AdvantageOutput
from miles.types import Group

if TYPE_CHECKING:
    import torch


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Generalized advantage estimates along the last dimension of ``rewards`` / ``values`` ([T] or [B, T]).

    ``δ_t = r_t + γ·V_{t+1} − V_t`` and ``A_t = δ_t + γλ·A_{t+1}``, with ``V_T = 0`` and
    ``A_T = 0`` past the end: the value after the last position is bootstrapped as 0, also
    for a truncated sample (the trajectory's reward is final; there is no state to value).

    Without ``mask`` every position is a step. With ``mask``, only the masked-in positions
    are steps, as if each row were compressed to them: ``t + 1`` is the next masked-in
    position, the masked-out positions in between (observations the policy did not write)
    add no reward, no value and no extra ``γλ`` decay, and get advantage 0.
    """
    import torch

    if rewards.shape != values.shape:
        raise ValueError(f"gae: rewards has shape {tuple(rewards.shape)}, values {tuple(values.shape)}")
    keep = torch.ones_like(rewards, dtype=torch.bool) if mask is None else mask.bool()
    advantages = torch.zeros_like(rewards)
    # The value and advantage of the next step, per row; they pass unchanged through masked-out positions.
    next_value = rewards.new_zeros(rewards.shape[:-1])
    next_advantage = rewards.new_zeros(rewards.shape[:-1])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        step = keep[..., t]
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        advantage = delta + gamma * lam * next_advantage
        advantages[..., t] = torch.where(step, advantage, 0.0)
        next_value = torch.where(step, values[..., t], next_value)
        next_advantage = torch.where(step, advantage, next_advantage)
    return advantages


class PPOOptions(ReinforcePPOptions):
    lam: float = Field(1.0, description="GAE's lambda, in [0, 1]")


class PPOAdvantage:
    """PPO: GAE over the loss tokens only, with the critic's values; the critic's targets are ``A + V``.

    Per sample, the response is compressed to its loss tokens (as in upstream Miles): token
    rewards ``r_t = −kl_coef·kl_t`` plus the scalar reward at the last loss token, values
    ``V_t = token_scores["values"][t]``, and ``gae(r, V, gamma, lam)`` with the value after
    the last loss token taken as 0. ``returns = A + V`` (before whitening) goes to
    ``AdvantageOutput.returns``; the advantages are then whitened over all loss tokens of the
    batch (``normalize``). Off the loss tokens both are 0.

    Options: ``gamma`` (1.0), ``lam`` (λ, 1.0), ``kl_coef`` (0.0), ``kl_type`` (``k1``),
    ``normalize`` (true). Requires ``values`` (and ``ref_logprobs`` when ``kl_coef > 0``).

    Metrics: ``advantages/mean_raw``, ``advantages/std_raw`` (before whitening),
    ``advantages/returns_mean``, ``advantages/values_mean`` (over loss tokens) and
    ``advantages/ref_kl`` when ``kl_coef > 0``.
    """

    default_loss = "ppo_clip"
    Options = PPOOptions

    def __init__(
        self,
        gamma: float = 1.0,
        lam: float = 1.0,
        kl_coef: float = 0.0,
        kl_type: KLType = "k1",
        normalize: bool = True,
    ) -> None:
        who = "ppo"
        self.gamma = check_unit_interval(gamma, "gamma", who)
        self.lam = check_unit_interval(lam, "lam", who)
        self.kl_coef = check_kl_coef(kl_coef, who)
        self.kl_type = check_kl_type(kl_type, who)
        self.normalize = check_flag(normalize, "normalize", who)
        self.requires: frozenset[str] = frozenset({VALUES, REF_LOGPROBS} if self.kl_coef else {VALUES})

    def __call__(self, groups: list[Group]) -> AdvantageOutput:
        import torch

        batch = TokenBatch.from_samples([s for g in groups for s in g.samples], who="ppo")
        values = batch.score(
            VALUES, why="PPO reads the critic's value predictions, filled by the trainer's scoring pass"
        )
        # Values off the loss tokens are never read; zero them so nothing odd there can leak into a sum.
        values = torch.where(batch.mask, values, 0.0)
        penalty, metrics = kl_penalty(batch, self.kl_coef, self.kl_type)
        token_rewards = terminal_rewards(batch, batch_rewards(groups)) - penalty
        advantages = gae(token_rewards, values, self.gamma, self.lam, batch.mask)
        returns = advantages + values
        metrics.update(advantage_metrics(advantages, batch.mask))
        metrics["advantages/returns_mean"] = masked_mean_std(returns, batch.mask)[0]
        metrics["advantages/values_mean"] = masked_mean_std(values, batch.mask)[0]
        if self.normalize:
            advantages = masked_whiten(advantages, batch.mask)
        return AdvantageOutput(
            advantages=batch.rows(advantages), returns=batch.rows(returns), metrics=metrics
        )
