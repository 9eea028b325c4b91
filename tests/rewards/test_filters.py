"""nonzero_std keeps only groups that carry a learning signal."""

from __future__ import annotations

import pytest

from miles.builtins.filters import nonzero_std
from miles.types import Group, Prompt, Sample


def group(rewards: list[float | None]) -> Group:
    prompt = Prompt(index=0, prompt="q")
    return Group(prompt=prompt, samples=[Sample(prompt=prompt, reward=r) for r in rewards])


@pytest.mark.parametrize(
    ("rewards", "keep"),
    [
        ([1.0, 0.0, 0.0, 0.0], True),
        ([0.0, 0.0, 0.0, 0.0], False),
        ([1.0, 1.0], False),
        ([0.3, 0.1 + 0.2], False),  # float noise is not a signal
        ([0.5], False),
        ([], False),
        ([None, 1.0], True),  # an unscored sample counts as 0
    ],
)
def test_nonzero_std(rewards: list[float | None], keep: bool) -> None:
    assert nonzero_std(group(rewards)) is keep
