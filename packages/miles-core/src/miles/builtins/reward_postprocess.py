"""Reward post-processors: ``(sample, reward) -> reward``, applied in order once a reward is known."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.types import Sample


class OverlongPenaltyOptions(ComponentOptions):
    max_len: int = Field(description="response length (tokens) at which the full penalty applies")
    cache_len: int = Field(
        description="the penalty grows over the last cache_len tokens before max_len (0 < cache_len < max_len)"
    )
    factor: float = Field(1.0, description="the full penalty (>= 0)")


class OverlongPenalty:
    """DAPO's soft overlong punishment: a penalty that grows linearly over the last ``cache_len`` tokens.

    With ``L = len(sample.response_ids)`` and ``start = max_len - cache_len``::

        L <= start              reward
        start < L <= max_len    reward + factor * (start - L) / cache_len    (0 down to -factor)
        L > max_len             reward - factor

    The penalty is continuous (``-factor`` at ``L = max_len``), so the policy is pushed
    towards shorter answers before it hits the hard limit rather than by a cliff at it.
    Usually ``max_len`` is ``rollout.max_new_tokens``, so a truncated response gets the
    full ``-factor``. ``L`` counts every response token, including the observation
    tokens a multi-turn generate function appends.
    """

    Options = OverlongPenaltyOptions

    def __init__(self, max_len: int, cache_len: int, factor: float = 1.0) -> None:
        for option, value in (("max_len", max_len), ("cache_len", cache_len)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"overlong_penalty: {option} must be an integer, got {value!r}")
        if not 0 < cache_len < max_len:
            raise ConfigError(
                "overlong_penalty: needs max_len > cache_len > 0, "
                f"got max_len={max_len}, cache_len={cache_len}"
            )
        if not _finite_number(factor) or factor < 0:
            raise ConfigError(f"overlong_penalty: factor must be a number >= 0, got {factor!r}")
        self.max_len = max_len
        self.cache_len = cache_len
        self.factor = float(factor)

    def __repr__(self) -> str:
        return f"OverlongPenalty(max_len={self.max_len}, cache_len={self.cache_len}, factor={self.factor:g})"

    def penalty(self, length: int) -> float:
        """The (non-positive) amount added to the reward of a response of ``length`` tokens."""
        start = self.max_len - self.cache_len
        if length <= start:
            return 0.0
        if length <= self.max_len:
            return self.factor * (start - length) / self.cache_len
        return -self.factor

    def __call__(self, sample: Sample, reward: float) -> float:
        return reward + self.penalty(len(sample.response_ids))


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
