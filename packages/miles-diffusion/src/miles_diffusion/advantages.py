"""``advantage: diffusion_grpo``: group-relative advantages of whole trajectories, one per sample.

A denoising trajectory is scored once, so its advantage is one number: the sample's reward
standardised within its group, ``(r - mean) / (std + eps)`` with the population std, exactly
the package's :func:`~miles_diffusion.flow_grpo.group_advantages` (so the core loop and the
package's own driver compute the same advantages from the same rewards). Each row of the output
holds that one entry; the diffusion backend reads it (the sample has no tokens to spread it over).
"""

from __future__ import annotations

import statistics

import torch
from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.interfaces import AdvantageOutput
from miles.types import Group
from miles_diffusion.flow_grpo import group_advantages


class TrajectoryGroupOptions(ComponentOptions):
    eps: float = Field(1e-4, gt=0.0, description="added to the group's reward std before dividing")


class TrajectoryGroupAdvantage:
    """Per group, ``A_i = (r_i - mean) / (std + eps)``; one advantage per trajectory."""

    name = "diffusion_grpo"
    default_loss = "flow_grpo"
    Options = TrajectoryGroupOptions

    def __init__(self, eps: float = 1e-4) -> None:
        self.eps = float(eps)
        self.requires: frozenset[str] = frozenset()

    def __call__(self, groups: list[Group]) -> AdvantageOutput:
        rows: list[list[float]] = []
        for group in groups:
            rewards = torch.tensor(group.rewards, dtype=torch.float32)
            rows.extend([a] for a in group_advantages(rewards, len(group.samples), self.eps).tolist())
        values = [r[0] for r in rows]
        return AdvantageOutput(
            advantages=rows,
            metrics={
                "advantages/mean_raw": statistics.fmean(values) if values else 0.0,
                "advantages/std_raw": statistics.stdev(values) if len(values) > 1 else 0.0,
            },
        )
