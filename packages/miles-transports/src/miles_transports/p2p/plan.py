"""The P2P transfer plan: which engine ranks (targets) each trainer rank (source) writes to.

Every target gets the whole model from exactly one source. The first
``min(sources, targets)`` targets map one to one (target ``i`` <- source ``i``);
the remaining targets are dealt round robin over the sources (target ``t`` <-
source ``t % sources``), so no source serves more than one target above any other.
With more sources than targets the surplus sources are idle for the update (they
still drain the weight stream, which is a collective on the trainer).

Round robin and least-loaded give the same assignment here (after the one-to-one
pass every source holds one target), and round robin is deterministic without tie
rules: every rank computes the same plan on its own, with no communication.
"""

from __future__ import annotations

from miles.errors import ConfigError


def plan_transfers(num_sources: int, num_targets: int) -> list[list[int]]:
    """Per source rank (index), the ascending target ranks it writes to.

    ``plan_transfers(2, 5) == [[0, 2, 4], [1, 3]]``; ``plan_transfers(3, 2) == [[0], [1], []]``.
    """
    if num_sources < 1:
        raise ConfigError(f"p2p plan: need at least one source (trainer rank), got {num_sources}")
    if num_targets < 0:
        raise ConfigError(f"p2p plan: the number of targets (engine ranks) must be >= 0, got {num_targets}")
    plan: list[list[int]] = [[] for _ in range(num_sources)]
    for target in range(num_targets):
        # For target < num_sources this is the one-to-one pass; past it, round robin.
        plan[target % num_sources].append(target)
    return plan
