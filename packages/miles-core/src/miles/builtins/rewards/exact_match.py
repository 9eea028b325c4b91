"""1.0 when the response equals the label, up to surrounding and repeated whitespace."""

from __future__ import annotations

from miles.builtins.rewards.labels import require_label
from miles.types import Sample


def normalize_whitespace(text: str) -> str:
    return " ".join(text.split())


def exact_match(sample: Sample) -> float:
    """Compare ``sample.response_text`` with ``sample.prompt.label`` (case-sensitive, whitespace-normalized)."""
    label = require_label(sample, "exact_match")
    return 1.0 if normalize_whitespace(sample.response_text) == normalize_whitespace(label) else 0.0
