"""The reward the agent function reported (``AgentResult.reward``), for agents that judge their own episode."""

from __future__ import annotations

from miles.types import Sample

AGENT_REWARD = "agent_reward"  # the sample metadata key the agentic generate function fills


def agent_reward(sample: Sample) -> float:
    """``sample.metadata["agent_reward"]``; an episode whose agent reported none fails (no made-up reward)."""
    value = sample.metadata.get(AGENT_REWARD)
    if value is None:
        raise ValueError(
            "reward 'agent' reads the reward the agent function returned, and this episode's agent returned "
            "none (return AgentResult(reward=...) or {'reward': ...} from the agent)"
        )
    return float(value)
