"""dapo: +1 for a final "Answer:" line equal to the label, -1 otherwise (format included)."""

from __future__ import annotations

import pytest

from miles.builtins.rewards.dapo import dapo_reward, extract_answer
from miles.errors import DataError
from miles.plugins import make_component
from miles.types import Prompt, Sample


def score(response: str, label: str | None = "72") -> float:
    return dapo_reward(Sample(prompt=Prompt(index=5, prompt="q", label=label), response_text=response))


CHAIN = (
    "Natalia sold 48 clips in April and half as many in May, so 48 / 2 = 24 in May.\n"
    "Altogether she sold 48 + 24 = 72 clips.\n\n"
)


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (CHAIN + "Answer: 72", "72", 1.0),
        (CHAIN + "Answer: 72\n", "72", 1.0),
        (CHAIN + "**Answer:** $\\boxed{72}$", "72", 1.0),
        (CHAIN + "Final answer: 72.", "72", 1.0),  # case-insensitive, trailing period dropped
        (CHAIN + "ANSWER: x = 72", "72", 1.0),  # a leading "x =" is dropped
        (CHAIN + "Answer: 72", "\\boxed{72}", 1.0),  # the label is normalized the same way
        ("Answer: 1,000", "1000", 1.0),  # thousands separator: the same number
        ("Answer: 3.0", "3", 1.0),
        ("Answer: $\\frac{1}{2}$", "0.5", 1.0),  # exact fractions: 1/2 == 0.5
        ("Answer: \\dfrac{3}{4}", "\\frac{3}{4}", 1.0),
        ("Answer: 70\nHmm, I dropped the 2 from May.\nAnswer: 72", "72", 1.0),  # the last one counts
        ("Answer: 72\nHmm, I dropped the 2 from May.\nAnswer: 70", "72", -1.0),
        (CHAIN + "Answer: 71", "72", -1.0),  # wrong
        (CHAIN + "Answer: 72 clips", "72", -1.0),  # no unit stripping
        (CHAIN + "The answer is \\boxed{72}.", "72", -1.0),  # no "Answer:" line: wrong format
        (CHAIN + "So the total is 72.", "72", -1.0),  # no answer at all
        (CHAIN + "Answer:", "72", -1.0),  # an empty answer
        ("", "72", -1.0),
        ("Answer: 0.333", "1/3", -1.0),  # a rounded decimal is not the fraction
        ("Answer: 2\\sqrt{2}", "\\sqrt{8}", -1.0),  # no symbolic equivalence (that is the math reward)
        # Reasoning is never read, even within the last 300 characters.
        ("<think>" + CHAIN + "Answer: 72</think>", "72", -1.0),
        ("<think>" + CHAIN + "Answer: 72", "72", -1.0),  # cut off while thinking
        ("<think>" + CHAIN + "Answer: 72?</think>\nAnswer: 72", "72", 1.0),
    ],
)
def test_dapo_reward(response: str, label: str, reward: float) -> None:
    assert score(response, label) == reward


def test_only_the_tail_is_read() -> None:
    # The answer line, then 300 characters of second thoughts: the window of the last 300
    # characters no longer holds "Answer:", so the response scores as having no answer.
    rambling = "\n" + "Let me double check this once more. " * 9  # 1 + 36 * 9 = 325 characters
    assert len(rambling) > 300
    assert score(CHAIN + "Answer: 72" + rambling) == -1.0
    assert score(CHAIN + "Answer: 72" + rambling[:200]) == 1.0  # still inside the window
    assert extract_answer("...\nAnswer: **42**  \nDone.") == "**42**"


def test_missing_label_is_a_data_error() -> None:
    with pytest.raises(DataError, match="'dapo' needs a label"):
        score("Answer: 72", label=None)


def test_selected_by_name() -> None:
    assert make_component("reward", "dapo") is dapo_reward
