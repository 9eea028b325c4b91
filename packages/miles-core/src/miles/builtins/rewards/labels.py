"""The label a reward compares against, or one clear error when the data has none."""

from __future__ import annotations

from miles.errors import DataError
from miles.types import Sample


def require_label(sample: Sample, reward: str) -> str:
    label = sample.prompt.label
    if label is None:
        raise DataError(
            f"reward {reward!r} needs a label, but prompt {sample.prompt.index} has none; "
            "set data.label_key to the field holding the answer"
        )
    return label
