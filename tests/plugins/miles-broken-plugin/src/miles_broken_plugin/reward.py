"""A reward that cannot load: the import below fails, as it would for a plugin missing a dependency."""

from __future__ import annotations

import miles_nonexistent_dependency

from miles.types import Sample


def score(sample: Sample) -> float:
    return float(miles_nonexistent_dependency.score(sample.response_text))
