from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch

from miles_diffusion import objectives
from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model
from miles_diffusion.nft import DiffusionNFTConfig, DiffusionNFTTrainer
from miles_diffusion.objectives import (
    ObjectiveContext,
    Rollout,
    RolloutObjective,
    SupervisedObjective,
    TrainerConfig,
    build_objective,
    objective_names,
    register_objective,
)
from miles_diffusion.recipe import load_recipe, recipe_from_dict
from miles_diffusion.sampler import SamplerConfig
from miles_diffusion.sft import SFTConfig, SFTTrainer
from miles_diffusion.train import run
from miles_diffusion.trainer import FlowGRPOTrainer

BASE = {"name": "x", "evidence_level": "not verified"}


def _context() -> ObjectiveContext:
    model = build_tiny_model(TinyFlowModelConfig(num_prompts=2, block_out_channels=(8, 16)), seed=0)
    return ObjectiveContext(model, TrainerConfig(), SamplerConfig(num_steps=2))


def test_the_three_objectives_are_registered_and_selected_by_name() -> None:
    assert {"flow_grpo", "diffusion_nft", "sft"} <= set(objective_names())
    assert isinstance(recipe_from_dict(BASE).objective, FlowGRPOConfig)  # no section: Flow-GRPO
    nft = recipe_from_dict({**BASE, "objective": {"name": "diffusion_nft", "beta": 0.5}}).objective
    assert nft == DiffusionNFTConfig(beta=0.5)
    ctx = _context()
    built = [build_objective(c, ctx) for c in (FlowGRPOConfig(), nft, SFTConfig())]
    assert [type(b) for b in built] == [FlowGRPOTrainer, DiffusionNFTTrainer, SFTTrainer]
    assert isinstance(built[0], RolloutObjective) and not isinstance(built[0], SupervisedObjective)
    assert isinstance(built[1], RolloutObjective) and not isinstance(built[1], SupervisedObjective)
    assert isinstance(built[2], SupervisedObjective) and not isinstance(built[2], RolloutObjective)


def test_unknown_objective_names_are_refused_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as caught:
        recipe_from_dict({**BASE, "objective": {"name": "ppo"}})
    assert str(caught.value) == f"unknown objective 'ppo'; allowed: {', '.join(objective_names())}"
    assert "diffusion_nft, flow_grpo, sft" in str(caught.value)
    with pytest.raises(ValueError, match=r"objective 'diffusion_nft': unknown keys \['clip_range'\]"):
        recipe_from_dict({**BASE, "objective": {"name": "diffusion_nft", "clip_range": 0.1}})
    with pytest.raises(ValueError, match="beta must be positive"):
        recipe_from_dict({**BASE, "objective": {"name": "diffusion_nft", "beta": 0.0}})


def test_shipped_recipes_name_their_objectives() -> None:
    assert isinstance(load_recipe("tiny_flow_grpo").objective, FlowGRPOConfig)
    assert isinstance(load_recipe("tiny_diffusion_nft").objective, DiffusionNFTConfig)
    sft = load_recipe("tiny_sft")
    assert isinstance(sft.objective, SFTConfig) and sft.reward is None and sft.dataset is not None


def test_an_objective_without_its_data_is_refused() -> None:
    sft = load_recipe("tiny_sft")
    with pytest.raises(ValueError, match="'sft' needs a dataset"):
        run(replace(sft, dataset=None, num_iterations=1))
    with pytest.raises(ValueError, match="'diffusion_nft' needs a reward"):
        run(replace(load_recipe("tiny_diffusion_nft"), reward=None, num_iterations=1))


@dataclass(frozen=True)
class _ConstantConfig:
    name: ClassVar[str] = "test_constant"
    value: float = 1.0


class _Constant:
    def __init__(self, config: _ConstantConfig) -> None:
        self.config = config

    def train_on_rollout(self, rollout: Rollout, generator: torch.Generator) -> dict[str, float]:
        return {"value": self.config.value}


@pytest.fixture
def registered_plugin() -> Iterator[None]:
    register_objective("test_constant", _ConstantConfig, lambda c, ctx: _Constant(c))
    yield
    del objectives._REGISTRY["test_constant"]


def test_a_plugin_objective_registers_and_runs(registered_plugin: None) -> None:
    recipe = recipe_from_dict(
        {
            **BASE,
            "num_iterations": 1,
            "prompts_per_iteration": 1,
            "group_size": 2,
            "eval_prompts_per_id": 1,
            "model": {"num_prompts": 2, "block_out_channels": [8, 16]},
            "sampler": {"num_steps": 2},
            "reward": {"name": "brightness"},
            "objective": {"name": "test_constant", "value": 3.0},
        }
    )
    (metrics,) = run(recipe)
    assert metrics["train/value"] == 3.0
    with pytest.raises(ValueError, match="already registered"):
        register_objective(
            "test_constant", type("Other", (), {"name": "test_constant"}), lambda c, x: _Constant(c)
        )
