"""GRPO advantages: each sample's reward compared with the other samples of its group."""

from __future__ import annotations

import math

from miles.errors import ConfigError
from miles.types import Group


class GRPOAdvantage:
    """Per group, ``A = (r - mean) / (std + eps)`` (or ``r - mean`` with ``normalize_std=False``, Dr. GRPO).

    ``std`` is the sample standard deviation (n - 1 in the denominator; 0 for a group of
    one). The sample's advantage is broadcast to every response token it trains on and is
    0 where ``loss_mask`` is 0. A group whose rewards are all equal gets all zeros.
    """

    def __init__(self, normalize_std: bool = True, eps: float = 1e-6) -> None:
        if not eps > 0:
            raise ConfigError(f"algorithm.advantage_options.eps must be > 0, got {eps!r}")
        self.normalize_std = normalize_std
        self.eps = eps

    def __call__(self, groups: list[Group]) -> list[list[float]]:
        rows: list[list[float]] = []
        for group in groups:
            for sample, value in zip(group.samples, self.group_advantages(group.rewards), strict=True):
                if len(sample.loss_mask) != len(sample.response_ids):
                    raise ValueError(
                        f"sample of prompt {sample.prompt.index}: loss_mask has {len(sample.loss_mask)} entries, "
                        f"response has {len(sample.response_ids)} tokens"
                    )
                rows.append([value if m else 0.0 for m in sample.loss_mask])
        return rows

    def group_advantages(self, rewards: list[float]) -> list[float]:
        n = len(rewards)
        if n == 0 or max(rewards) == min(rewards):
            # Exactly zero: the floating-point mean of equal values can differ from them in the last bit.
            return [0.0] * n
        mean = sum(rewards) / n
        centered = [r - mean for r in rewards]
        if not self.normalize_std:
            return centered
        std = math.sqrt(sum(c * c for c in centered) / (n - 1)) if n > 1 else 0.0
        return [c / (std + self.eps) for c in centered]
