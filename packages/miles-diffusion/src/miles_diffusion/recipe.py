"""A diffusion recipe: one YAML file naming the model, sampler, reward, objective and run length.

The ``objective`` section names a registered objective (``name``, default ``flow_grpo``; see
:mod:`miles_diffusion.objectives`) and sets that objective's own config. A supervised objective
(``sft``) also needs a ``dataset`` section; a rollout objective needs a ``reward``. A ``lora``
section (the core's: ``rank``, ``alpha``, ``dropout``, ``target_modules``, ``name``) trains a peft
adapter instead of every weight (:mod:`miles_diffusion.lora`; the driver writes it to ``DIR/adapter``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from miles.config.schema import LoraSection
from miles_diffusion.datasets import ShapesDatasetConfig
from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.guidance import check_unconditional
from miles_diffusion.model import TinyFlowModelConfig
from miles_diffusion.objectives import ObjectiveConfig, TrainerConfig, check_guidance, objective_config
from miles_diffusion.precision import PrecisionConfig
from miles_diffusion.sampler import SamplerConfig

EVIDENCE_LEVELS = ("fully gated", "proxy gated", "verified", "not verified")


@dataclass(frozen=True)
class RewardSpec:
    name: str = "target_colour"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DiffusionRecipe:
    name: str
    evidence_level: str
    seed: int = 0
    deterministic: bool = True
    num_iterations: int = 10
    prompts_per_iteration: int = 2
    group_size: int = 8
    eval_prompts_per_id: int = 4
    eval_seed: int = 1234
    model: TinyFlowModelConfig | str = field(default_factory=TinyFlowModelConfig)
    """The tiny UNet's shape (built from ``seed``), or a model directory: a path or ``builtin:NAME``,
    loaded by the family its files name (:mod:`miles_diffusion.families`, e.g. an SD3 / SD3.5
    diffusers directory)."""
    prompts: tuple[str, ...] | None = None
    """A text family's prompts: prompt id ``i`` is ``prompts[i]`` (the tiny UNet takes bare ids)."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: RewardSpec | None = field(default_factory=RewardSpec)
    """Scores rollouts (rollout objectives) and the evaluation samples; ``null`` for none (SFT)."""
    objective: ObjectiveConfig = field(default_factory=FlowGRPOConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dataset: ShapesDatasetConfig | None = None
    """The given images a supervised objective trains on."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Compute dtype of the model's forward and the modules kept in FP32 (default: all FP32)."""
    lora: LoraSection | None = None
    """A LoRA adapter on the denoiser (a pipeline family's transformer) instead of every weight."""

    def __post_init__(self) -> None:
        if self.evidence_level not in EVIDENCE_LEVELS:
            raise ValueError(f"evidence_level must be one of {EVIDENCE_LEVELS}")
        if self.prompts is not None:
            object.__setattr__(self, "prompts", tuple(str(p) for p in self.prompts))
            if isinstance(self.model, TinyFlowModelConfig):
                raise ValueError("prompts: texts are for a model directory of a text family (e.g. sd3)")
        check_guidance(self.objective, self.sampler.guidance_scale)
        if isinstance(self.model, TinyFlowModelConfig):
            check_unconditional("the tiny UNet (model: a shape)", False, self.sampler.guidance_scale)
        if self.lora is not None and self.trainer.fsdp_ranks > 1:
            raise ValueError("lora: the driver trains an adapter on one rank only (trainer.fsdp_ranks: 1)")
        if self.trainer.sequence_parallel > 1 and isinstance(self.model, TinyFlowModelConfig):
            raise ValueError(
                "trainer.sequence_parallel: the tiny UNet has no token sequence to split; "
                "sequence parallelism is for a model directory's transformer (wan)"
            )
        if self.trainer.sequence_parallel > 1 and self.objective.name != FlowGRPOConfig.name:
            raise ValueError(
                f"trainer.sequence_parallel: sequence parallelism is tested with flow_grpo only, "
                f"not {self.objective.name!r}; set trainer.sequence_parallel: 1"
            )


def _build(cls: type, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
    values = dict(data)
    if "block_out_channels" in values:
        values["block_out_channels"] = tuple(values["block_out_channels"])
    return cls(**values)


_SECTIONS: dict[str, type] = {
    "model": TinyFlowModelConfig,
    "sampler": SamplerConfig,
    "reward": RewardSpec,
    "trainer": TrainerConfig,
    "dataset": ShapesDatasetConfig,
    "precision": PrecisionConfig,
}
_NULLABLE = ("reward", "dataset")
DEFAULT_OBJECTIVE = FlowGRPOConfig.name


def recipe_from_dict(data: dict[str, Any]) -> DiffusionRecipe:
    values = dict(data)
    for key, cls in _SECTIONS.items():
        if key in values:
            if values[key] is None and key in _NULLABLE:
                continue
            if key == "model" and isinstance(values[key], str):
                continue  # a model directory (path or builtin:NAME)
            values[key] = _build(cls, values[key] or {})
    if values.get("lora") is not None:
        values["lora"] = LoraSection(**values["lora"])
    if "objective" in values:
        section = dict(values["objective"] or {})
        values["objective"] = objective_config(section.pop("name", DEFAULT_OBJECTIVE), section)
    result: DiffusionRecipe = _build(DiffusionRecipe, values)
    return result


def load_recipe(path_or_name: str) -> DiffusionRecipe:
    """Load a YAML file, or a recipe shipped in ``miles_diffusion/recipes`` by its stem."""
    path = Path(path_or_name)
    if path.is_file():
        text = path.read_text()
    else:
        text = resources.files("miles_diffusion.recipes").joinpath(f"{path_or_name}.yaml").read_text()
    return recipe_from_dict(yaml.safe_load(text))
