"""overlong_penalty: DAPO's soft length penalty over the last cache_len tokens before max_len."""

from __future__ import annotations

import pytest

from miles.builtins.reward_postprocess import OverlongPenalty
from miles.errors import ConfigError
from miles.plugins import make_component
from miles.types import Prompt, Sample


def of_length(n: int) -> Sample:
    return Sample(prompt=Prompt(index=0, prompt="q"), response_ids=[7] * n)


# max_len = 20, cache_len = 8: start = 12. Inside (12, 20] the penalty is (12 - L) / 8.
@pytest.mark.parametrize(
    ("length", "reward", "expected"),
    [
        (0, 1.0, 1.0),
        (12, 1.0, 1.0),  # L = start: unchanged
        (13, 1.0, 0.875),  # (12 - 13) / 8 = -0.125
        (16, 1.0, 0.5),  # (12 - 16) / 8 = -0.5
        (20, 1.0, 0.0),  # L = max_len: (12 - 20) / 8 = -1, continuous with the next case
        (21, 1.0, 0.0),  # L > max_len: -factor
        (500, 1.0, 0.0),
        (16, -1.0, -1.5),  # the penalty adds to any reward, negative ones included
        (16, 0.25, -0.25),
    ],
)
def test_penalty_from_the_formula(length: int, reward: float, expected: float) -> None:
    assert OverlongPenalty(max_len=20, cache_len=8)(of_length(length), reward) == pytest.approx(expected)


def test_factor_scales_the_penalty() -> None:
    post = OverlongPenalty(max_len=20, cache_len=8, factor=0.5)
    assert post(of_length(16), 1.0) == pytest.approx(0.75)  # 1 + 0.5 * (12 - 16) / 8
    assert post(of_length(30), 1.0) == pytest.approx(0.5)  # 1 - 0.5
    assert OverlongPenalty(max_len=20, cache_len=8, factor=0)(of_length(30), 1.0) == 1.0


@pytest.mark.parametrize(
    ("options", "match", "declared"),
    [
        ({"max_len": 8, "cache_len": 8}, "max_len > cache_len > 0", None),
        ({"max_len": 8, "cache_len": 0}, "max_len > cache_len > 0", None),
        ({"max_len": 4, "cache_len": 8}, "max_len > cache_len > 0", None),
        # A wrong type is refused by the options model first, when the component is made by name.
        ({"max_len": 20.5, "cache_len": 8}, "max_len must be an integer", r"option 'max_len' \(int\) of"),
        (
            {"max_len": 20, "cache_len": True},
            "cache_len must be an integer",
            r"option 'cache_len' \(int\) of",
        ),
        ({"max_len": 20, "cache_len": 8, "factor": -1}, "factor must be a number >= 0", None),
        ({"max_len": 20, "cache_len": 8, "factor": float("nan")}, "factor must be a number >= 0", None),
    ],
)
def test_bad_options_are_config_errors(options: dict, match: str, declared: str | None) -> None:
    with pytest.raises(ConfigError, match=match):
        OverlongPenalty(**options)
    with pytest.raises(ConfigError, match=declared or match):
        make_component("reward_postprocess", "overlong_penalty", options)


def test_selected_by_name() -> None:
    post = make_component("reward_postprocess", "overlong_penalty", {"max_len": 20, "cache_len": 8})
    assert isinstance(post, OverlongPenalty)
    with pytest.raises(ConfigError, match="needs option 'cache_len'"):
        make_component("reward_postprocess", "overlong_penalty", {"max_len": 20})
