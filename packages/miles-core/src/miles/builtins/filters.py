"""Built-in group filters: a filter returns True to keep a finished group, False to drop it."""

from __future__ import annotations

from miles.capabilities import FilterNeeds, declare_needs
from miles.types import Group, Status

# Rewards closer than this count as equal: float noise must not pass for a learning signal.
REWARD_TOLERANCE = 1e-8


@declare_needs(FilterNeeds(min_group_size=2))  # one sample has no spread: every group would be dropped
def nonzero_std(group: Group) -> bool:
    """Keep groups whose rewards are not all equal; an all-equal group has zero GRPO advantage everywhere."""
    rewards = group.rewards
    return len(rewards) > 1 and max(rewards) - min(rewards) > REWARD_TOLERANCE


def no_aborted(group: Group) -> bool:
    """Keep groups in which no sample was ABORTED.

    An aborted trajectory (the engine gave up on it, e.g. during a weight update) has no
    reward, and a group-relative advantage over the remaining samples would use a partial
    group. The built-in rollout stage already sets such groups aside before the filters
    (and hands their prompts back to the data source); this filter states the rule for
    rollout stages and buffers that do not.
    """
    return all(sample.status is not Status.ABORTED for sample in group.samples)
