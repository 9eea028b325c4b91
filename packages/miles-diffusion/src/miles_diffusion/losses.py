"""The package's objectives as core losses (``algorithm.loss: flow_grpo`` / ``diffusion_nft``, and
``diffusion_sft`` for ``mode: sft``).

A recipe names its objective where every recipe does (``algorithm.loss`` and ``loss_options``), and
the core resolves it like any loss (a policy loss, or a supervised one for ``diffusion_sft``, options
validated against its model with the recipe's file and line). What it resolves to is the objective's
config: the diffusion backend builds the objective from it (``miles_diffusion.objectives``) and trains
whole denoising trajectories (or given images) with it.
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
from miles_diffusion.sft import SFTConfig


def options_model(config_type: type, name: str) -> type[BaseModel]:
    """A strict options model with one field per field of an objective's config dataclass."""
    hints = typing.get_type_hints(config_type)
    specs: dict[str, Any] = {}
    for f in fields(config_type):
        specs[f.name] = (hints[f.name], f.default if f.default is not MISSING else ...)
    return create_model(f"{name}Options", __base__=ComponentOptions, __module__=__name__, **specs)


class ObjectiveLoss:
    """The config of one of the package's objectives, resolved as a core loss (see the module docstring)."""

    kind: ClassVar[str]
    requires: frozenset[str] = frozenset()
    objective: ClassVar[str]

    def __init__(self, **options: Any) -> None:
        try:
            self.config: ObjectiveConfig = objective_config(self.objective, options)
        except ValueError as exc:  # the objective's own checks (e.g. beta > 0)
            raise ComponentError(f"algorithm.loss {self.objective!r}: {exc}") from None

    def __call__(self, inputs: LossInputs) -> LossOutput:
        raise ComponentError(
            f"loss {self.objective!r} is a diffusion objective: only the diffusion backend "
            "(backend: diffusion) trains it; a token backend has nothing for it to score"
        )


class TrajectoryObjectiveLoss(ObjectiveLoss):
    """A trajectory objective (trains on rollouts), resolved as a policy loss."""

    kind = "policy"


class SupervisedObjectiveLoss(ObjectiveLoss):
    """An objective on given images (``mode: sft``), resolved as a supervised loss."""

    kind = "supervised"


class FlowGRPOLoss(TrajectoryObjectiveLoss):
    """``flow_grpo``: the clipped ratio loss of re-scored denoising steps (+ optional KL to the start)."""

    objective = FlowGRPOConfig.name
    Options = options_model(FlowGRPOConfig, "FlowGRPO")


class DiffusionNFTLoss(TrajectoryObjectiveLoss):
    """``diffusion_nft``: negative-aware fine-tuning on the forward process of the sampled images."""

    objective = DiffusionNFTConfig.name
    Options = options_model(DiffusionNFTConfig, "DiffusionNFT")


class DiffusionSFTLoss(SupervisedObjectiveLoss):
    """``diffusion_sft``: flow matching on given images (``mode: sft``; the package objective ``sft``)."""

    objective = SFTConfig.name
    Options = options_model(SFTConfig, "DiffusionSFT")
