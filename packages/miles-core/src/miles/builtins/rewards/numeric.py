"""A graded numeric reward: full credit for the right number, partial credit for a near one.

``reward = max(0, 1 - |predicted - label| / scale)``, and 0 when the response holds no
number. Exact-match rewards give a policy that starts from random weights almost no
signal (it must hit the one right token by chance); this one rewards producing a number
at all and then getting closer, so a tiny model from random weights gets a signal from its first
step (on the default recipe it learns to answer with a middling number, not the sum itself:
docs/benchmarks.md §15).
The answer is extracted like the ``math`` reward does (last ``\\boxed{}``, else the last
number), so a response that is exactly right scores exactly 1.0.
"""

from __future__ import annotations

from pydantic import Field

from miles.builtins.rewards.labels import require_label
from miles.builtins.rewards.math import extract_answer, normalize, reference_answer, to_number
from miles.capabilities import ComponentOptions
from miles.errors import DataError
from miles.types import Sample


class NumericClosenessOptions(ComponentOptions):
    scale: float = Field(10.0, description="how far off an answer may be and still earn credit (> 0)")


class NumericCloseness:
    Options = NumericClosenessOptions

    def __init__(self, scale: float = 10.0) -> None:
        if scale <= 0:
            raise ValueError(f"numeric_closeness: scale must be > 0, got {scale}")
        self.scale = scale

    def __call__(self, sample: Sample) -> float:
        label = require_label(sample, "numeric_closeness")
        target = to_number(normalize(reference_answer(label)))
        if target is None:
            raise DataError(
                f"numeric_closeness: label {label!r} of prompt {sample.prompt.index} is not a number"
            )
        answer = extract_answer(sample.response_text)
        value = to_number(normalize(answer)) if answer is not None else None
        if value is None:
            return 0.0
        return max(0.0, 1.0 - float(abs(value - target)) / self.scale)
