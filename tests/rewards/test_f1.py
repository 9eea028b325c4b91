"""f1: SQuAD-style token F1 of the response's answer against one or several acceptable answers."""

from __future__ import annotations

import pytest

from miles.builtins.rewards.f1 import acceptable_answers, extract_answer, f1_reward, normalize_text, token_f1
from miles.errors import DataError
from miles.plugins import make_component
from miles.types import Prompt, Sample


def score(response: str, label: str | None) -> float:
    return f1_reward(Sample(prompt=Prompt(index=2, prompt="q", label=label), response_text=response))


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        # Exact after normalization: case, punctuation and the article do not matter.
        ("Answer: The Denver Broncos.", "Denver Broncos", 1.0),
        # pred {denver, broncos, won}, gold {denver, broncos}: common 2, P = 2/3, R = 1,
        # F1 = 2 * (2/3) / (2/3 + 1) = (4/3) / (5/3) = 0.8
        ("Answer: The Denver Broncos won.", "Denver Broncos", 0.8),
        # pred {broncos}, gold {denver, broncos}: P = 1, R = 1/2, F1 = 1 / 1.5 = 2/3
        ("<answer>Broncos</answer>", "Denver Broncos", 2 / 3),
        # Several acceptable answers (a JSON list): the best one, "Broncos", matches exactly.
        ("<answer>Broncos</answer>", '["Denver Broncos", "Broncos"]', 1.0),
        ("Answer: Carolina Panthers", '["Denver Broncos", "Broncos"]', 0.0),  # wrong
        # No marker: the whole text after </think>; pred {it, was, denver, broncos}, gold
        # {denver, broncos}: P = 2/4, R = 1, F1 = 2 * 0.5 / 1.5 = 2/3
        ("<think>Maybe the Panthers? No.</think>\nIt was the Denver Broncos.", "Denver Broncos", 2 / 3),
        # The reasoning is never scored, even when it names the answer.
        ("<think>Answer: Denver Broncos</think>\nI don't know.", "Denver Broncos", 0.0),
        (
            "The final result is \\boxed{\\text{Saint Bernadette Soubirous}}",
            "Saint Bernadette Soubirous",
            1.0,
        ),
        # Repeated tokens count once per occurrence in the gold: pred {cat, cat}, gold {cat}:
        # common 1, P = 1/2, R = 1, F1 = 2/3
        ("Answer: the cat, the cat", "cat", 2 / 3),
        ("Answer: “U.S.” — Navy", "US Navy", 1.0),  # Unicode quotes and dashes are punctuation
        ("", "Denver Broncos", 0.0),  # no answer at all
        ("Answer: the", "Denver Broncos", 0.0),  # nothing left after normalization
        ("<answer></answer>", '[""]', 1.0),  # SQuAD v2: "no answer" matches an empty gold
        ("<answer>Broncos</answer>", '[""]', 0.0),  # ...and nothing else
        ("<answer>A</answer>", "", 0.0),  # not even what SQuAD's normalization would erase
        # A gold answer the normalization erases is still an answer: an empty response is wrong.
        ("", "A", 0.0),
        ("<answer></answer>", "The", 0.0),
        ("<think>It is A.</think>", "A", 0.0),  # the reasoning is removed: no answer is left
        ("Answer: A.", "A", 1.0),  # compared keeping articles: "a" == "a"
        ("Answer: (a)", "A", 1.0),
        ("Answer: the", "A", 0.0),  # no longer "both empty"
        ("Answer: ?", "?", 1.0),  # punctuation only: compared on case and whitespace alone
        ("Answer: !", "?", 0.0),
        # A response cut off while still thinking has no answer, even when it looks like one.
        ("<think>Answer: Denver Broncos", "Denver Broncos", 0.0),
        # Reasoning the prompt opened ends at a </think> that closes nothing.
        ("Maybe the Panthers?</think>Answer: Denver Broncos", "Denver Broncos", 1.0),
    ],
)
def test_f1_reward(response: str, label: str, reward: float) -> None:
    assert score(response, label) == pytest.approx(reward)


def test_normalization() -> None:
    assert normalize_text("  The  Quick, brown FOX! ") == "quick brown fox"
    assert normalize_text("an apple a day") == "apple day"
    assert normalize_text("theater") == "theater"  # only whole-word articles go
    # "the" as the gold answer is kept (the articles are compared), so "a" is wrong and "The" right.
    assert token_f1("a", "the") == 0.0
    assert token_f1("The", "the") == 1.0
    assert token_f1("", "A") == 0.0
    assert token_f1("", "") == 1.0
    assert token_f1(" ", "\t") == 1.0
    assert token_f1("a", "") == 0.0


def test_extraction_order() -> None:
    assert extract_answer("Answer: one\n<answer>two</answer>") == "two"
    assert extract_answer("Answer: one\n\\boxed{two}") == "two"
    assert extract_answer("Answer: one\nAnswer: two\nthanks") == "two"
    assert extract_answer("just text") == "just text"


def test_label_conventions() -> None:
    assert acceptable_answers('["a", "b"]') == ["a", "b"]
    assert acceptable_answers("Denver") == ["Denver"]
    assert acceptable_answers("[citation needed]") == ["[citation needed]"]  # not JSON: one answer
    assert acceptable_answers("[1, 2]") == ["[1, 2]"]  # not a list of strings: one answer
    with pytest.raises(DataError, match="prompt 2 is an empty JSON list"):
        score("x", "[]")
    with pytest.raises(DataError, match="'f1' needs a label"):
        score("x", None)


def test_selected_by_name() -> None:
    assert make_component("reward", "f1") is f1_reward
