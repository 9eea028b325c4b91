"""GRPO and GSPO advantages: each sample's reward compared with the other samples of its group."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.interfaces import AdvantageOutput
from miles.types import Group


def centered_rewards(rewards: Sequence[float]) -> list[float]:
    """``r_i − mean(r)`` within one group; exactly 0 for every sample of a group whose rewards are all equal.

    (The floating-point mean of equal values can differ from them in the last bit, so that
    case is decided before subtracting.)
    """
    n = len(rewards)
    if n == 0 or max(rewards) == min(rewards):
        return [0.0] * n
    mean = sum(rewards) / n
    return [r - mean for r in rewards]


class GRPOOptions(ComponentOptions):
    normalize_std: bool = Field(
        True, description="divide by the group's reward std (false: Dr. GRPO, r - mean only)"
    )
    eps: float = Field(1e-6, description="added to the std before dividing (> 0)")


class GRPOAdvantage:
    """Per group, ``A_i = (r_i − mean) / (std + eps)``, or ``r_i − mean`` with ``normalize_std=False`` (Dr. GRPO).

    ``std`` is the group's sample standard deviation (``n − 1`` in the denominator). The
    sample's advantage is broadcast to every response token it trains on and is 0 where
    ``loss_mask`` is 0. A group whose rewards are all equal, and a group of one, gets all
    zeros. A sample without a reward counts as reward 0. There is no KL term here; a KL
    penalty against the reference model belongs in the loss.

    Metrics: ``advantages/mean_raw`` and ``advantages/std_raw``, the mean and sample std of
    the advantages over all loss tokens of the batch (no whitening here, so "raw" is final).
    """

    name = "grpo"  # in error messages
    default_loss = "ppo_clip"
    Options = GRPOOptions

    def __init__(self, normalize_std: bool = True, eps: float = 1e-6) -> None:
        who = self.name
        if not isinstance(normalize_std, bool):
            raise ConfigError(f"{who}: normalize_std must be true or false, got {normalize_std!r}")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
            raise ConfigError(f"{who}: eps must be a number > 0, got {eps!r}")
        self.normalize_std = normalize_std
        self.eps = float(eps)
        self.requires: frozenset[str] = frozenset()

    def __call__(self, groups: list[Group]) -> AdvantageOutput:
        rows: list[list[float]] = []
        values: list[float] = []  # one per sample, for the metrics
        counts: list[int] = []  # loss tokens per sample
        for group in groups:
            for sample, value in zip(group.samples, self.group_advantages(group.rewards), strict=True):
                if len(sample.loss_mask) != len(sample.response_ids):
                    raise ValueError(
                        f"{self.name}: sample {sample.group_index} of prompt {sample.prompt.index}: "
                        f"loss_mask has {len(sample.loss_mask)} entries, "
                        f"response has {len(sample.response_ids)} tokens"
                    )
                rows.append([value if m else 0.0 for m in sample.loss_mask])
                values.append(value)
                counts.append(sum(1 for m in sample.loss_mask if m))
        mean, std = _token_weighted_mean_std(values, counts)
        return AdvantageOutput(
            advantages=rows, metrics={"advantages/mean_raw": mean, "advantages/std_raw": std}
        )

    def group_advantages(self, rewards: list[float]) -> list[float]:
        """The advantage of each sample of one group, from the group's rewards."""
        centered = centered_rewards(rewards)
        n = len(rewards)
        if not self.normalize_std or n < 2 or not any(centered):
            return centered
        std = math.sqrt(sum(c * c for c in centered) / (n - 1))
        return [c / (std + self.eps) for c in centered]


class GSPOAdvantage(GRPOAdvantage):
    """GSPO's advantages are GRPO's; GSPO differs in its loss, which clips a sequence-level ratio.

    Same options and metrics as ``GRPOAdvantage``; only the default loss is ``gspo``.
    """

    name = "gspo"
    default_loss = "gspo"


def _token_weighted_mean_std(values: list[float], counts: list[int]) -> tuple[float, float]:
    """Mean and sample std over tokens, where ``values[i]`` fills ``counts[i]`` tokens (0 for n <= 1)."""
    n = sum(counts)
    if n == 0:
        return 0.0, 0.0
    mean = sum(v * c for v, c in zip(values, counts, strict=True)) / n
    if n < 2:
        return mean, 0.0
    var = sum(c * (v - mean) ** 2 for v, c in zip(values, counts, strict=True)) / (n - 1)
    return mean, math.sqrt(var)
