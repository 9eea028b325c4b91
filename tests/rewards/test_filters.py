"""nonzero_std keeps groups that carry a learning signal; no_aborted drops groups with an aborted sample."""

from __future__ import annotations

import pytest

from miles.builtins.filters import no_aborted, nonzero_std
from miles.plugins import load_component
from miles.types import Group, Prompt, Sample, Status


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


def with_statuses(*statuses: Status) -> Group:
    prompt = Prompt(index=0, prompt="q")
    return Group(prompt=prompt, samples=[Sample(prompt=prompt, status=s, reward=1.0) for s in statuses])


@pytest.mark.parametrize(
    ("statuses", "keep"),
    [
        ((Status.COMPLETED, Status.COMPLETED), True),
        ((Status.COMPLETED, Status.TRUNCATED, Status.FAILED), True),  # only aborts drop a group
        ((Status.COMPLETED, Status.ABORTED), False),
        ((Status.ABORTED,), False),
        ((), True),
    ],
)
def test_no_aborted(statuses: tuple[Status, ...], keep: bool) -> None:
    assert no_aborted(with_statuses(*statuses)) is keep


def test_filters_are_selected_by_name() -> None:
    assert load_component("filter", "no_aborted") is no_aborted
    assert load_component("filter", "nonzero_std") is nonzero_std
