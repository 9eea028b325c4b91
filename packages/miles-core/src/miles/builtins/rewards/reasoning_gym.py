"""Scores a response with the ``score_answer`` of the reasoning-gym task that generated its prompt."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from pydantic import Field

from miles.builtins.data.reasoning_gym import INSTALL_HINT, METADATA_KEY
from miles.builtins.rewards.reasoning import strip_reasoning
from miles.capabilities import ComponentOptions
from miles.errors import ComponentError, DataError
from miles.types import Sample


class ReasoningGymRewardOptions(ComponentOptions):
    answer_tag: str | None = Field(
        "answer", description="score the last <tag>...</tag> of the response (null: the whole response)"
    )


class ReasoningGymReward:
    """Reward for prompts from the ``reasoning_gym`` data source (values in [0, 1], partial credit per task).

    The answer scored is the content of the last ``<answer_tag>...</answer_tag>`` in the
    response when there is one (reasoning-gym's own convention), else the whole response
    stripped; either way outside the response's ``<think>`` reasoning (``strip_reasoning``). ``answer_tag=None`` always scores the whole response.
    """

    Options = ReasoningGymRewardOptions

    def __init__(self, answer_tag: str | None = "answer") -> None:
        self.answer_tag = answer_tag
        self._tag = (
            re.compile(f"<{re.escape(answer_tag)}>(.*?)</{re.escape(answer_tag)}>", re.DOTALL)
            if answer_tag
            else None
        )

    def __call__(self, sample: Sample) -> float:
        info = sample.prompt.metadata.get(METADATA_KEY)
        if not isinstance(info, dict) or "task" not in info or "entry" not in info:
            raise DataError(
                f"reward 'reasoning_gym' scores prompts from the reasoning_gym data source; prompt "
                f"{sample.prompt.index} has no metadata[{METADATA_KEY!r}] with its task and entry"
            )
        score = _score_fn(info["task"])
        return float(score(answer=self.extract(sample.response_text), entry=info["entry"]))

    def extract(self, response: str) -> str:
        response = strip_reasoning(response)
        if self._tag is not None:
            found = self._tag.findall(response)
            if found:
                return found[-1].strip()
        return response.strip()


@functools.cache
def _score_fn(task: str) -> Callable[..., Any]:
    try:
        import reasoning_gym
    except ImportError:
        raise ComponentError(
            f"reward 'reasoning_gym' needs the reasoning-gym package; install it with `{INSTALL_HINT}`"
        ) from None
    try:
        return reasoning_gym.get_score_answer_fn(task)
    except ValueError as exc:
        raise DataError(f"reward 'reasoning_gym': {exc}") from None
