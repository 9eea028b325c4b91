"""The built-in objective, rewards, filters and data sources load by name, like any plugin."""

from __future__ import annotations

import pytest

from miles.builtins.algorithms.grpo import GRPOAdvantage
from miles.builtins.algorithms.ppo_clip import PPOClipLoss
from miles.builtins.algorithms.tis import TruncatedIS
from miles.builtins.data.files import FileDataSource
from miles.builtins.data.hf import HFDataSource
from miles.builtins.data.reasoning_gym import ReasoningGymDataSource
from miles.builtins.filters import nonzero_std
from miles.builtins.rewards.exact_match import exact_match
from miles.builtins.rewards.math import math_reward
from miles.builtins.rewards.reasoning_gym import ReasoningGymReward
from miles.config.schema import AlgorithmSection, DataSection
from miles.plugins import load_component, make_component


def test_objective_from_the_default_algorithm_section() -> None:
    section = AlgorithmSection(
        loss_options={"clip_high": 0.3, "dual_clip": 3.0}, correction_options={"high": 4.0}
    )
    adv = make_component("advantage", section.advantage, section.advantage_options)
    loss = make_component("loss", section.loss or adv.default_loss, section.loss_options)
    corr = make_component("correction", section.correction, section.correction_options)
    assert isinstance(adv, GRPOAdvantage) and adv.normalize_std
    assert isinstance(loss, PPOClipLoss) and (loss.clip_low, loss.clip_high, loss.dual_clip) == (
        0.2,
        0.3,
        3.0,
    )
    assert isinstance(corr, TruncatedIS) and (corr.low, corr.high) == (0.0, 4.0)


def test_rewards_and_filters() -> None:
    assert load_component("reward", "exact_match") is exact_match
    assert load_component("reward", "math") is math_reward
    assert isinstance(make_component("reward", "reasoning_gym", {"answer_tag": "final"}), ReasoningGymReward)
    assert load_component("filter", "nonzero_std") is nonzero_std


def test_data_sources_by_name() -> None:
    assert load_component("data_source", "jsonl") is FileDataSource
    assert load_component("data_source", "parquet") is FileDataSource
    assert load_component("data_source", "hf") is HFDataSource
    assert load_component("data_source", "reasoning_gym") is ReasoningGymDataSource
    cfg = DataSection(path="builtin:arith")
    source = make_component("data_source", cfg.source, cfg.model_dump(exclude={"source"}))
    assert isinstance(source, FileDataSource) and len(source) == 55


def test_reasoning_gym_source_from_a_recipe_section() -> None:
    pytest.importorskip("reasoning_gym")
    cfg = DataSection(source="reasoning_gym", path="chain_sum", options={"size": 5})
    source = make_component("data_source", cfg.source, cfg.model_dump(exclude={"source"}))
    assert len(source) == 5
