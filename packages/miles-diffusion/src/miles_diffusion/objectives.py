"""Replaceable training objectives, selected by name in a recipe's ``objective`` section.

An objective is built from its own frozen config dataclass (the recipe's ``objective`` section less
its ``name`` key) and an :class:`ObjectiveContext` (the model, the optimizer settings, the sampler
settings). It is one of two kinds, told apart by the method it has:

- a :class:`RolloutObjective` trains on what the driver sampled and scored (:class:`Rollout`):
  Flow-GRPO (``flow_grpo``, re-scores recorded denoising steps) and DiffusionNFT (``diffusion_nft``,
  trains on the forward process of the sampled images);
- a :class:`SupervisedObjective` trains on batches of given images (:class:`ImageBatch`): diffusion
  SFT (``sft``).

``register_objective`` adds a new one (a plug-in registers at import); the built-in three are
registered on first use. An unknown name is refused with the list of the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.sampler import SamplerConfig, Trajectory


@dataclass(frozen=True)
class TrainerConfig:
    """Optimizer settings shared by every objective, and Flow-GRPO's step selection."""

    lr: float = 3e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    train_step_fraction: float = 0.6
    """Flow-GRPO: fraction of the denoising steps re-scored and trained on each iteration."""
    steps_per_update: int = 2
    """Denoising steps (Flow-GRPO) or noise levels (DiffusionNFT) accumulated into one optimizer step."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    """AdamW's betas and epsilon (torch's defaults)."""
    fsdp_ranks: int = 1
    """The package driver only (``python -m miles_diffusion.train``): with more than 1, the driver runs
    that many local CPU ranks over gloo and Flow-GRPO trains data-parallel on FSDP2
    (:mod:`miles_diffusion.fsdp`); 1 is the plain one-process trainer."""
    sequence_parallel: int = 1
    """The package driver's FSDP2 ranks in groups of this many that re-score the same trajectories, each
    on a share of the token sequence (:mod:`miles_diffusion.sequence_parallel`); must divide
    ``fsdp_ranks``. 1: no sequence parallelism."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        if self.fsdp_ranks < 1:
            raise ValueError(f"trainer.fsdp_ranks must be at least 1, got {self.fsdp_ranks}")
        if self.sequence_parallel < 1 or self.fsdp_ranks % self.sequence_parallel:
            raise ValueError(
                f"trainer.sequence_parallel {self.sequence_parallel} must be at least 1 and divide "
                f"trainer.fsdp_ranks {self.fsdp_ranks}"
            )


@dataclass(frozen=True)
class Rollout:
    """What the driver sampled and scored in one iteration.

    ``trajectory`` holds ``B`` trajectories, ``group_size`` consecutive ones per prompt;
    ``rewards``: [B]. ``advantages`` ([B]), when given, are used as they are (the core loop's
    advantage estimator computed them); otherwise each objective derives them from the rewards of
    each group of ``group_size``.
    """

    trajectory: Trajectory
    rewards: torch.Tensor
    group_size: int
    advantages: torch.Tensor | None = None


@dataclass(frozen=True)
class ImageBatch:
    """Given images in the model's range [-1, 1] ([B, C, H, W]) and their prompt ids ([B])."""

    images: torch.Tensor
    prompts: torch.Tensor


@runtime_checkable
class RolloutObjective(Protocol):
    def train_on_rollout(self, rollout: Rollout, generator: torch.Generator) -> dict[str, float]:
        """Update the model from one iteration's rollout; ``generator`` is the run's seeded RNG."""
        ...


@runtime_checkable
class SupervisedObjective(Protocol):
    def train_on_batch(self, batch: ImageBatch, generator: torch.Generator) -> dict[str, float]:
        """Update the model from one batch of given images; ``generator`` is the run's seeded RNG."""
        ...


Objective = RolloutObjective | SupervisedObjective


class ObjectiveConfig(Protocol):
    """A frozen dataclass of one objective's settings; ``name`` is the recipe name it answers to."""

    name: ClassVar[str]


def check_guidance(config: ObjectiveConfig, guidance_scale: float) -> None:
    """Refuse a guidance scale above 1 for an objective that does not train on guided samples.

    An objective config declares ``guidance: ClassVar[str | None]``: ``None`` when it trains correctly
    on trajectories sampled with classifier-free guidance, else why not. One that declares nothing
    (a plug-in written before guidance existed) is refused too: it never said it re-scores guided steps."""
    from miles_diffusion.guidance import NO_GUIDANCE, GuidanceError

    if guidance_scale == NO_GUIDANCE:
        return
    reason = getattr(type(config), "guidance", "it does not declare support for guided samples")
    if reason is not None:
        raise GuidanceError(
            f"guidance_scale {guidance_scale} with objective {config.name!r}: {reason}; set guidance_scale "
            "1.0 or use flow_grpo"
        )


@dataclass(frozen=True)
class ObjectiveContext:
    model: DiffusionModel
    trainer: TrainerConfig
    sampler: SamplerConfig


C = TypeVar("C")


@dataclass(frozen=True)
class ObjectiveEntry(Generic[C]):
    config_type: type[C]
    build: Callable[[C, ObjectiveContext], Objective]


_REGISTRY: dict[str, ObjectiveEntry[Any]] = {}
_BUILTINS_LOADED = False


def register_objective(
    name: str, config_type: type[C], build: Callable[[C, ObjectiveContext], Objective]
) -> None:
    """Make ``name`` selectable in recipes. ``config_type`` is a frozen dataclass whose class
    attribute ``name`` equals ``name``; ``build`` makes the objective from a config and a context."""
    if getattr(config_type, "name", None) != name:
        raise ValueError(f"{config_type.__name__}.name must be {name!r} to register it under that name")
    if name in _REGISTRY and _REGISTRY[name].config_type is not config_type:
        raise ValueError(f"an objective named {name!r} is already registered")
    _REGISTRY[name] = ObjectiveEntry(config_type, build)


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    # Imported here: those modules import this one for the batch types and protocols.
    from miles_diffusion.flow_grpo import FlowGRPOConfig
    from miles_diffusion.nft import DiffusionNFTConfig, DiffusionNFTTrainer
    from miles_diffusion.sft import SFTConfig, SFTTrainer
    from miles_diffusion.trainer import FlowGRPOTrainer

    def flow_grpo(config: FlowGRPOConfig, ctx: ObjectiveContext) -> Objective:
        return FlowGRPOTrainer(
            ctx.model, config, ctx.trainer, ctx.sampler.noise_level, ctx.sampler.guidance_scale
        )

    def diffusion_nft(config: DiffusionNFTConfig, ctx: ObjectiveContext) -> Objective:
        return DiffusionNFTTrainer(ctx.model, config, ctx.trainer)

    def sft(config: SFTConfig, ctx: ObjectiveContext) -> Objective:
        return SFTTrainer(ctx.model, config, ctx.trainer)

    register_objective(FlowGRPOConfig.name, FlowGRPOConfig, flow_grpo)
    register_objective(DiffusionNFTConfig.name, DiffusionNFTConfig, diffusion_nft)
    register_objective(SFTConfig.name, SFTConfig, sft)


def objective_names() -> list[str]:
    """The names a recipe may select, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def _entry(name: str) -> ObjectiveEntry[Any]:
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown objective {name!r}; allowed: {', '.join(objective_names())}")
    return _REGISTRY[name]


def objective_config(name: str, options: Mapping[str, Any]) -> ObjectiveConfig:
    """Build the config of objective ``name`` from a recipe section; unknown keys are refused."""
    config_type = _entry(name).config_type
    known = {f.name for f in fields(config_type)}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"objective {name!r}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    config: ObjectiveConfig = config_type(**options)
    return config


def build_objective(config: ObjectiveConfig, context: ObjectiveContext) -> Objective:
    """The objective ``config`` configures, training ``context.model``."""
    entry = _entry(config.name)
    if not isinstance(config, entry.config_type):
        raise TypeError(f"objective {config.name!r} takes a {entry.config_type.__name__}")
    check_guidance(config, context.sampler.guidance_scale)
    return entry.build(config, context)
