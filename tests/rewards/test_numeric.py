import pytest

from miles.builtins.rewards.numeric import NumericCloseness
from miles.errors import DataError
from miles.types import Prompt, Sample


def _sample(response: str, label: str = "7") -> Sample:
    return Sample(prompt=Prompt(index=3, prompt="3+4=", label=label), response_text=response)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("7", 1.0),
        ("the answer is 7", 1.0),
        ("5", 0.8),
        ("12", 0.5),
        ("40", 0.0),
        ("no digits", 0.0),
        ("\\boxed{6}", 0.9),
        ("7.5", 0.95),
    ],
)
def test_closeness_from_the_formula(response, expected):
    assert NumericCloseness(scale=10)(_sample(response)) == pytest.approx(expected)


def test_scale_and_bad_label_are_refused():
    with pytest.raises(ValueError, match="scale"):
        NumericCloseness(scale=0)
    with pytest.raises(DataError, match="not a number"):
        NumericCloseness()(_sample("7", label="seven"))
