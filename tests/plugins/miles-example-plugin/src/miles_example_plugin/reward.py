"""A length-penalty reward: full marks up to a target length, less for every token beyond it."""

from __future__ import annotations

import miles_example_plugin
from miles.types import Sample

# Reward lost per response token beyond the target; 10 extra tokens cost the whole reward.
PENALTY_PER_TOKEN = 0.1


def length_penalty_reward(sample: Sample) -> float:
    """``1 - PENALTY_PER_TOKEN * max(0, length - target)``, floored at 0.

    ``length`` counts response tokens (whitespace-separated words when the sample
    carries text only); ``target`` is ``miles_example_plugin.target_length`` (the
    recipe's ``example.target_length``, 8 by default). Use it alone to teach brevity,
    or as a template for shaping terms.
    """
    length = len(sample.response_ids) if sample.response_ids else len(sample.response_text.split())
    excess = max(0, length - miles_example_plugin.target_length)
    return max(0.0, 1.0 - PENALTY_PER_TOKEN * excess)
