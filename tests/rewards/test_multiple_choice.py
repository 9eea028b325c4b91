"""multiple_choice: the letter the response settles on, compared with the label's letter."""

from __future__ import annotations

import pytest

from miles.builtins.rewards.multiple_choice import MultipleChoiceReward
from miles.errors import ComponentError, ConfigError, DataError
from miles.plugins import make_component
from miles.types import Prompt, Sample

REWARD = MultipleChoiceReward()


def sample(response: str, label: str | None = "C") -> Sample:
    return Sample(prompt=Prompt(index=4, prompt="q", label=label), response_text=response)


GPQA_STYLE = (
    "The reaction is an SN2 substitution, so the stereocenter inverts.\n"
    "Option A keeps the configuration, which is wrong. Option B is the elimination product.\n"
)


@pytest.mark.parametrize(
    ("response", "chosen"),
    [
        (GPQA_STYLE + "Answer: C", "C"),
        (GPQA_STYLE + "The answer is (C).", "C"),
        (GPQA_STYLE + "Therefore, the correct option is C.", "C"),
        (GPQA_STYLE + "**Final Answer:** **C**", "C"),
        (GPQA_STYLE + "The answer is: [C] 2-bromobutane", "C"),
        (GPQA_STYLE + "Answer: Option C", "C"),
        (GPQA_STYLE + "So the answer is $\\boxed{C}$", "C"),
        (GPQA_STYLE + "\\boxed{(C)}", "C"),
        (GPQA_STYLE + "\\boxed{\\text{C}}", "C"),
        (GPQA_STYLE + "C.", "C"),  # a final line that is only the letter
        (GPQA_STYLE + "(C)\n\n", "C"),
        # The last statement wins over earlier ones (a self-correction).
        ("The answer is A. Wait, A keeps the configuration.\nThe answer is (C).", "C"),
        ("Answer: C\nHmm, no: the base is too bulky, so elimination wins.\nAnswer: B", "B"),
        ("So \\boxed{A}.\nOn reflection A keeps the configuration; it must be\n**C**", "C"),
        # Letters only mentioned are not answers; no statement is no answer.
        (GPQA_STYLE, None),
        ("Option C looks plausible but I am not sure.", None),
        ("", None),
        ("The answer is Apple.", None),  # a word, not a letter
        ("the answer is a tough one", None),  # lowercase "a" is the article
        ("The answer is B.\nMy answer: I am fairly sure of it.", "B"),  # "I" before a word is the pronoun
        ("The answer is B.\nAnswer: K", None),  # the final statement names no valid letter
        # Reasoning is never read: only the answer given after it counts.
        ("<think>The answer is B? Option B keeps it.\nB</think>\nAnswer: C", "C"),
        ("<think>\\boxed{A}</think>The answer is (C).", "C"),
        ("<think>Answer: A</think>", None),  # all reasoning: no answer
        ("<think>Answer: A</think>\nI cannot decide.", None),
        # Cut off while thinking: an unclosed <think> runs to the end, so nothing after it counts.
        ("<think>Answer: A", None),
        ("<think>It is A.\nA", None),
        ("Answer: C\n<think>hmm, maybe A?\nA", "C"),  # the answer before the new reasoning stands
        # A chat template with thinking on opens <think> in the prompt: the response starts inside it.
        ("Answer: A looks right.\nA</think>\nAnswer: C", "C"),
        ("Answer: A\n</think>", None),
        ("<think>a <think>nested</think> B</think>\nD", "D"),
    ],
)
def test_extraction(response: str, chosen: str | None) -> None:
    assert REWARD.extract(response) == chosen


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (GPQA_STYLE + "Answer: C", "C", 1.0),
        (GPQA_STYLE + "Answer: C", "(C)", 1.0),
        (GPQA_STYLE + "Answer: C", "c", 1.0),
        (GPQA_STYLE + "Answer: C", "C.", 1.0),
        (GPQA_STYLE + "Answer: B", "C", 0.0),  # wrong
        (GPQA_STYLE, "C", 0.0),  # no answer
        ("<think>" + GPQA_STYLE + "Answer: C</think>\nAnswer: B", "C", 0.0),  # reasoning is not the answer
        ("<think>" + GPQA_STYLE + "Answer: C", "C", 0.0),  # cut off before answering
        ("<think>" + GPQA_STYLE + "</think>\nAnswer: C", "C", 1.0),
    ],
)
def test_reward(response: str, label: str, reward: float) -> None:
    assert REWARD(sample(response, label)) == reward


def test_choices_option() -> None:
    four = make_component("reward", "multiple_choice", {"choices": "ABCD"})
    assert four(sample("Answer: D", "D")) == 1.0
    assert four(sample("The answer is D.\nAnswer: E", "D")) == 0.0  # E is not a choice here
    with pytest.raises(DataError, match="label 'E' of prompt 4 is not one of the letters ABCD"):
        four(sample("Answer: E", "E"))
    with pytest.raises(DataError, match="'multiple_choice' needs a label"):
        four(sample("Answer: D", None))
    with pytest.raises(DataError, match="not one of the letters"):
        four(sample("Answer: D", "Paris"))


@pytest.mark.parametrize("choices", ["", "abcd", "AAB", "A-D", 4])
def test_bad_choices(choices: object) -> None:
    with pytest.raises(ConfigError, match="choices must be distinct uppercase letters"):
        MultipleChoiceReward(choices=choices)  # type: ignore[arg-type]
    with pytest.raises((ComponentError, ConfigError)):
        make_component("reward", "multiple_choice", {"choices": choices})


def test_selected_by_name_with_defaults() -> None:
    reward = make_component("reward", "multiple_choice")
    assert isinstance(reward, MultipleChoiceReward)
    assert reward.choices == "ABCDEFGHIJ"
