"""GRPOAdvantage against hand-computed values."""

from __future__ import annotations

import pytest

from miles.builtins.algorithms.grpo import GRPOAdvantage
from miles.errors import ConfigError
from miles.interfaces import AdvantageEstimator
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
    rows = est([group([1.0, 0.0, 0.0, 1.0], [[1, 1, 0], [1], [0, 1], [1, 0, 1, 1]])])
    a = 0.8660239
    expected = [[a, a, 0.0], [-a], [0.0, -a], [a, 0.0, a, a]]
    assert len(rows) == 4
    for got, want in zip(rows, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


def test_groups_are_normalized_independently_and_unnormalized_mode() -> None:
    # Group 1: rewards 3, 1 -> mean 2, std sqrt(2) = 1.4142136 -> +-1/1.4142146 = +-0.7071063
    # Group 2: rewards 0, 0, 3 -> mean 1, centered -1, -1, 2, std sqrt(6/2) = 1.7320508
    rows = GRPOAdvantage()([group([3.0, 1.0]), group([0.0, 0.0, 3.0])])
    assert [r[0] for r in rows] == pytest.approx(
        [0.7071063, -0.7071063, -0.5773501, -0.5773501, 1.1547003], abs=1e-6
    )
    rows = GRPOAdvantage(normalize_std=False)([group([3.0, 1.0]), group([0.0, 0.0, 3.0])])
    assert [r[0] for r in rows] == [1.0, -1.0, -1.0, -1.0, 2.0]


def test_identical_rewards_and_single_samples_give_exact_zeros() -> None:
    rows = GRPOAdvantage()([group([0.1, 0.1, 0.1]), group([1.0]), group([None, 0.0])])
    assert rows == [[0.0, 0.0]] * 6


def test_misaligned_mask_and_bad_eps() -> None:
    bad = group([1.0, 0.0])
    bad.samples[0].loss_mask = [1]
    with pytest.raises(ValueError, match="loss_mask has 1 entries, response has 2 tokens"):
        GRPOAdvantage()([bad])
    with pytest.raises(ConfigError, match="eps must be > 0"):
        GRPOAdvantage(eps=0.0)
