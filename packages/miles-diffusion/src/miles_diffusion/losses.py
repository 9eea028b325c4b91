"""The trajectory objectives as core losses (``algorithm.loss: flow_grpo`` / ``diffusion_nft``).

A recipe names its objective where every recipe does (``algorithm.loss`` and ``loss_options``), and
the core resolves it like any loss (a policy loss, options validated against its model with the
recipe's file and line). What it resolves to is the objective's config: the diffusion backend builds
the objective from it (``miles_diffusion.objectives``) and trains whole denoising trajectories with it.
It is not a token loss: a token backend that calls it gets one error saying so, and the recipe check
(``miles_diffusion.hooks``) refuses that pairing before anything starts.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields
from typing import Any, ClassVar

from pydantic import BaseModel, create_model

from miles.capabilities import ComponentOptions
from miles.errors import ComponentError
from miles.interfaces import LossInputs, LossOutput
from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.nft import DiffusionNFTConfig
from miles_diffusion.objectives import ObjectiveConfig, objective_config


def options_model(config_type: type, name: str) -> type[BaseModel]:
    """A strict options model with one field per field of an objective's config dataclass."""
    hints = typing.get_type_hints(config_type)
    specs: dict[str, Any] = {}
    for f in fields(config_type):
        specs[f.name] = (hints[f.name], f.default if f.default is not MISSING else ...)
    return create_model(f"{name}Options", __base__=ComponentOptions, __module__=__name__, **specs)


class TrajectoryObjectiveLoss:
    """The config of one trajectory objective, resolved as a policy loss (see the module docstring)."""

    kind = "policy"
    requires: frozenset[str] = frozenset()
    objective: ClassVar[str]

    def __init__(self, **options: Any) -> None:
        try:
            self.config: ObjectiveConfig = objective_config(self.objective, options)
        except ValueError as exc:  # the objective's own checks (e.g. beta > 0)
            raise ComponentError(f"algorithm.loss {self.objective!r}: {exc}") from None

    def __call__(self, inputs: LossInputs) -> LossOutput:
        raise ComponentError(
            f"loss {self.objective!r} is a diffusion trajectory objective: only the diffusion backend "
            "(backend: diffusion) trains it; a token backend has nothing for it to score"
        )


class FlowGRPOLoss(TrajectoryObjectiveLoss):
    """``flow_grpo``: the clipped ratio loss of re-scored denoising steps (+ optional KL to the start)."""

    objective = FlowGRPOConfig.name
    Options = options_model(FlowGRPOConfig, "FlowGRPO")


class DiffusionNFTLoss(TrajectoryObjectiveLoss):
    """``diffusion_nft``: negative-aware fine-tuning on the forward process of the sampled images."""

    objective = DiffusionNFTConfig.name
    Options = options_model(DiffusionNFTConfig, "DiffusionNFT")
