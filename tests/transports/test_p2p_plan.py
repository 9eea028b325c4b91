"""The P2P transfer plan: which engines each trainer rank writes to (hand-written expectations)."""

from __future__ import annotations

import pytest

from miles.errors import ConfigError
from miles_transports.p2p.plan import plan_transfers


def test_fewer_sources_than_targets_first_one_to_one_then_round_robin():
    # Targets 0, 1 go one to one; 2, 3, 4 are dealt to sources 0, 1, 0.
    assert plan_transfers(2, 5) == [[0, 2, 4], [1, 3]]
    assert plan_transfers(3, 7) == [[0, 3, 6], [1, 4], [2, 5]]
    assert plan_transfers(1, 3) == [[0, 1, 2]]


def test_as_many_sources_as_targets_is_one_to_one():
    assert plan_transfers(1, 1) == [[0]]
    assert plan_transfers(4, 4) == [[0], [1], [2], [3]]


def test_extra_sources_are_idle():
    assert plan_transfers(3, 2) == [[0], [1], []]
    assert plan_transfers(4, 1) == [[0], [], [], []]
    assert plan_transfers(2, 0) == [[], []]


@pytest.mark.parametrize("sources", range(1, 7))
@pytest.mark.parametrize("targets", range(0, 13))
def test_every_target_has_exactly_one_source_and_loads_differ_by_at_most_one(sources, targets):
    plan = plan_transfers(sources, targets)
    assert len(plan) == sources
    assert sorted(t for mine in plan for t in mine) == list(range(targets))
    busy = [len(mine) for mine in plan if mine]
    assert len(busy) == min(sources, targets)
    assert not busy or max(busy) - min(busy) <= 1
    assert all(mine == sorted(mine) for mine in plan)


def test_bad_counts_are_refused_with_what_is_allowed():
    with pytest.raises(ConfigError, match="at least one source"):
        plan_transfers(0, 3)
    with pytest.raises(ConfigError, match=">= 0"):
        plan_transfers(2, -1)
