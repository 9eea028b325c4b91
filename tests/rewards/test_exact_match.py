"""exact_match: equal up to whitespace."""

from __future__ import annotations

import pytest

from miles.builtins.rewards.exact_match import exact_match
from miles.errors import DataError
from miles.types import Prompt, Sample


def sample(response: str, label: str | None) -> Sample:
    return Sample(prompt=Prompt(index=3, prompt="3+4=", label=label), response_text=response)


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("7", "7", 1.0),
        ("  7\n", "7", 1.0),
        ("New   York\tCity", " New York City ", 1.0),
        ("7.", "7", 0.0),
        ("77", "7", 0.0),
        ("paris", "Paris", 0.0),
        ("", "7", 0.0),
    ],
)
def test_exact_match(response: str, label: str, reward: float) -> None:
    assert exact_match(sample(response, label)) == reward


def test_no_label_is_a_data_error() -> None:
    with pytest.raises(DataError, match=r"reward 'exact_match' needs a label, but prompt 3 has none"):
        exact_match(sample("7", None))
