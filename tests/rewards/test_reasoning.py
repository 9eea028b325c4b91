"""strip_reasoning: the part of a response every answer-reading reward looks at."""

from __future__ import annotations

import pytest

from miles.builtins.rewards.reasoning import strip_reasoning


@pytest.mark.parametrize(
    ("response", "visible"),
    [
        ("Answer: C", "Answer: C"),  # no reasoning: unchanged
        ("<think>maybe B</think>\nAnswer: C", "\nAnswer: C"),
        ("Let me see. <think>maybe B</think>So: C", "Let me see. So: C"),  # text around a block stays
        ("<think>one</think>A<think>two</think>B", "AB"),  # every block goes
        ("<think>maybe B</think>", ""),
        # An unclosed <think> runs to the end: the model was cut off while thinking.
        ("<think>maybe B", ""),
        ("Answer: C\n<think>or B?", "Answer: C\n"),
        ("<think>x</think>Answer: C<think>or B?", "Answer: C"),
        # A </think> closing nothing ends reasoning the prompt opened: all before it goes.
        ("maybe B\nB</think>Answer: C", "Answer: C"),
        ("B</think>C</think>D", "D"),
        ("<think>outer <think>inner</think> still thinking</think>C", "C"),  # nested blocks
        ("", ""),
    ],
)
def test_strip_reasoning(response: str, visible: str) -> None:
    assert strip_reasoning(response) == visible
