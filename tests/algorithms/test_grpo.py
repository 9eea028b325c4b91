"""GRPOAdvantage and GSPOAdvantage against hand-computed values."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.grpo import GRPOAdvantage, GSPOAdvantage
from miles.errors import ConfigError
from miles.interfaces import AdvantageEstimator, AdvantageOutput
from miles.plugins import make_component
from miles.types import Group, Prompt, Sample


def group(rewards: list[float | None], masks: list[list[int]] | None = None) -> Group:
    prompt = Prompt(index=0, prompt="q")
    masks = masks or [[1, 1] for _ in rewards]
    samples = [
        Sample(prompt=prompt, group_index=i, response_ids=[5] * len(m), loss_mask=m, reward=r)
        for i, (r, m) in enumerate(zip(rewards, masks, strict=True))
    ]
    return Group(prompt=prompt, samples=samples)


def test_normalized_by_the_group_std_and_broadcast_over_trained_tokens() -> None:
    # rewards 1,0,0,1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.5773503 -> A = +-0.5 / 0.5773513 = +-0.8660239
    est = GRPOAdvantage()
    assert isinstance(est, AdvantageEstimator)
    out = est([group([1.0, 0.0, 0.0, 1.0], [[1, 1, 0], [1], [0, 1], [1, 0, 1, 1]])])
    assert isinstance(out, AdvantageOutput) and out.returns is None
    a = 0.8660239
    expected = [[a, a, 0.0], [-a], [0.0, -a], [a, 0.0, a, a]]
    assert len(out.advantages) == 4
    for got, want in zip(out.advantages, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    # Metrics over the 7 loss tokens: 5 of +a, 2 of -a -> mean 3a/7;
    # var = (5 (a - 3a/7)^2 + 2 (-a - 3a/7)^2) / 6 = (5·16 + 2·100) a² / (49·6) = 20a²/21.
    assert out.metrics["advantages/mean_raw"] == pytest.approx(3 * a / 7, abs=1e-6)
    assert out.metrics["advantages/std_raw"] == pytest.approx(a * math.sqrt(20 / 21), abs=1e-6)


def test_groups_are_normalized_independently_and_unnormalized_mode() -> None:
    # Group 1: rewards 3, 1 -> mean 2, std sqrt(2) = 1.4142136 -> +-1/1.4142146 = +-0.7071063
    # Group 2: rewards 0, 0, 3 -> mean 1, centered -1, -1, 2, std sqrt(6/2) = 1.7320508
    rows = GRPOAdvantage()([group([3.0, 1.0]), group([0.0, 0.0, 3.0])]).advantages
    assert [r[0] for r in rows] == pytest.approx(
        [0.7071063, -0.7071063, -0.5773501, -0.5773501, 1.1547003], abs=1e-6
    )
    rows = GRPOAdvantage(normalize_std=False)([group([3.0, 1.0]), group([0.0, 0.0, 3.0])]).advantages
    assert [r[0] for r in rows] == [1.0, -1.0, -1.0, -1.0, 2.0]


def test_identical_rewards_and_single_samples_give_exact_zeros() -> None:
    out = GRPOAdvantage()([group([0.1, 0.1, 0.1]), group([1.0]), group([None, 0.0])])
    assert out.advantages == [[0.0, 0.0]] * 6
    assert out.metrics == {"advantages/mean_raw": 0.0, "advantages/std_raw": 0.0}
    assert GRPOAdvantage()([]).advantages == []


def test_gspo_has_grpo_advantages_and_its_own_default_loss() -> None:
    groups = [group([1.0, 0.0, 0.5], [[1, 0], [1, 1], [0, 0]])]
    grpo, gspo = GRPOAdvantage(), GSPOAdvantage()
    assert gspo(groups) == grpo(groups)
    assert (grpo.default_loss, gspo.default_loss) == ("ppo_clip", "gspo")
    assert grpo.requires == gspo.requires == frozenset()


def test_loaded_by_name_with_recipe_options() -> None:
    est = make_component("advantage", "gspo", {"normalize_std": False})
    assert isinstance(est, GSPOAdvantage) and not est.normalize_std
    assert isinstance(make_component("advantage", "grpo", {}), GRPOAdvantage)


def test_misaligned_mask_and_bad_options() -> None:
    bad = group([1.0, 0.0])
    bad.samples[0].loss_mask = [1]
    with pytest.raises(
        ValueError, match="sample 0 of prompt 0: loss_mask has 1 entries, response has 2 tokens"
    ):
        GRPOAdvantage()([bad])
    with pytest.raises(ConfigError, match="eps must be a number > 0"):
        GRPOAdvantage(eps=0.0)
    with pytest.raises(ConfigError, match="normalize_std must be true or false"):
        GRPOAdvantage(normalize_std="no")  # type: ignore[arg-type]
