"""Built-in group filters: a filter returns True to keep a finished group, False to drop it."""

from __future__ import annotations

from miles.types import Group

# Rewards closer than this count as equal: float noise must not pass for a learning signal.
REWARD_TOLERANCE = 1e-8


def nonzero_std(group: Group) -> bool:
    """Keep groups whose rewards are not all equal; an all-equal group has zero GRPO advantage everywhere."""
    rewards = group.rewards
    return len(rewards) > 1 and max(rewards) - min(rewards) > REWARD_TOLERANCE
