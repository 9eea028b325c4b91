"""What the multi-turn and agentic generate functions share: the prompt as messages, and
turning a recorded session into the trajectory's samples (their settings: miles_envs.context)."""

from __future__ import annotations

from typing import Any, Literal

from miles.types import Prompt, Sample, Status
from miles_envs.sessions import Session, session_samples


def prompt_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """The prompt as chat messages: a text prompt is one user message."""
    if isinstance(prompt.prompt, str):
        return [{"role": "user", "content": prompt.prompt}]
    return [dict(m) for m in prompt.prompt]


def episode_samples(
    session: Session,
    slot: Sample,
    *,
    selection: Literal["drop_retries", "all"] = "drop_retries",
    truncated: bool = False,
    failure: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> list[Sample]:
    """The samples a finished episode yields (one for a linear session, one per selected leaf).

    ``slot`` is the sample the rollout made for this attempt: an episode that recorded no turn
    comes back as that slot, failed, with the reason in its metadata. ``truncated``: the
    episode ran out of its token or turn budget, so it did not end by itself. Every sample's
    metadata gets ``metadata`` and ``tool_calls`` (the session's tool calls, all branches).
    """
    samples = session_samples(
        session, slot.prompt, group_index=slot.group_index, selection=selection, failure=failure
    )
    extra = {
        "tool_calls": sum(len(c.assistant.tool_calls) for c in session.checkpoints()),
        **(metadata or {}),
    }
    if not samples:
        slot.status = Status.FAILED
        slot.metadata.update(extra, failure=failure or "the episode recorded no turn")
        return [slot]
    for sample in samples:
        sample.metadata.update(extra)
        if truncated and sample.status is Status.COMPLETED:
            sample.status = Status.TRUNCATED
    return samples
