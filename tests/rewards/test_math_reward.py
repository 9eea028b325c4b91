"""math_reward on answers that look like real model output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles.builtins.rewards.math import answers_match, extract_answer, math_reward
from miles.errors import DataError
from miles.types import Prompt, Sample


def score(response: str, label: str) -> float:
    return math_reward(Sample(prompt=Prompt(index=0, prompt="q", label=label), response_text=response))


GSM_RESPONSE = (
    "Natalia sold 48/2 = 24 clips in May.\n"
    "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (GSM_RESPONSE, "72", 1.0),
        (GSM_RESPONSE, "Natalia sold 48+24 = 72 clips.\n#### 72", 1.0),  # a GSM8K-style solution as label
        (GSM_RESPONSE, "71", 0.0),
        ("3+4=7", "7", 1.0),
        ("7", "7", 1.0),
        ("So the total is 5 - 8 = -3.", "-3", 1.0),
        ("The probability is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("The probability is \\boxed{\\dfrac{1}{2}}.", "1/2", 1.0),
        ("That makes \\boxed{1,000} apples in total.", "1000", 1.0),
        ("We need $1,250.50 in total.", "1250.5", 1.0),
        ("Half of it: 0.5", "\\frac{1}{2}", 1.0),
        ("Thus $x = \\boxed{2\\sqrt{2}}$.", "\\sqrt{8}", 1.0),
        ("Expanding, \\boxed{x^2 + 2x + 1}.", "(x+1)^2", 1.0),
        ("The angle is \\boxed{90^\\circ}.", "90", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{5}. Check: 2 + 4 = 6.", "5", 1.0),  # the box wins over later numbers
        ("\\boxed{5}. Check: 2 + 4 = 6.", "6", 0.0),
        ("0.333", "1/3", 0.0),  # exact comparison: a rounded decimal is not the fraction
        ("I am not sure.", "7", 0.0),
        ("", "7", 0.0),
        ("\\boxed{}", "7", 0.0),
        ("x = 1 or x = 2", "(1, 2)", 0.0),
        # LaTeX's unbraced shorthand is the braced form: one character or command per argument.
        ("\\boxed{2\\sqrt3}", "2\\sqrt{3}", 1.0),
        ("\\boxed{2\\sqrt{3}}", "2\\sqrt3", 1.0),
        ("\\boxed{\\frac12}", "0.5", 1.0),
        ("\\boxed{\\frac1{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}4}", "0.75", 1.0),
        ("\\boxed{\\frac{\\sqrt3}2}", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("\\boxed{\\frac\\pi2}", "\\frac{\\pi}{2}", 1.0),
        ("\\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),
        ("\\boxed{\\sqrt[3]8}", "2", 1.0),
        ("\\boxed{\\sqrt x + 1}", "1 + \\sqrt{x}", 1.0),
        ("\\boxed{2\\sqrt3}", "2\\sqrt{2}", 0.0),
        # \sqrt12 is \sqrt{1}2 = 2 as LaTeX renders it, not \sqrt{12}.
        ("\\boxed{\\sqrt12}", "\\sqrt{12}", 0.0),
        ("\\boxed{\\sqrt12}", "2", 1.0),
        # The reasoning is never read: a number or box inside <think> is not the answer.
        ("<think>maybe \\boxed{5}</think>The answer is 7.", "7", 1.0),
        ("<think>maybe \\boxed{5}</think>The answer is 7.", "5", 0.0),
        ("<think>3+4 is 7, so \\boxed{7}", "7", 0.0),  # cut off while thinking: no answer
        ("3+4 is 7</think>\\boxed{7}", "7", 1.0),  # the prompt opened the reasoning
    ],
)
def test_math_reward(response: str, label: str, reward: float) -> None:
    assert score(response, label) == reward


def test_extraction() -> None:
    assert extract_answer("first \\boxed{1} then \\boxed{\\frac{3}{4}} done") == "\\frac{3}{4}"
    assert extract_answer("\\fbox{12}") == "12"
    assert extract_answer("so it is \\boxed 7$.") == "7"
    assert extract_answer("v1.5 has 3 parts") == "3"
    assert extract_answer("nothing here") is None
    assert extract_answer("<think>it is 5</think>") is None
    assert extract_answer("<think>it is 5</think>\\boxed{6} (not 5)") == "6"


def test_shorthand_without_sympy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The braced form is compared as text, so the shorthand matches even when sympy is missing.
    monkeypatch.setitem(sys.modules, "sympy", None)
    assert answers_match("2\\sqrt3", "2\\sqrt{3}")
    assert answers_match("\\frac{1}2", "0.5")
    assert answers_match("\\frac 3 4", "\\frac{3}{4}")


def test_untrusted_answers_are_never_evaluated(tmp_path: Path) -> None:
    marker = tmp_path / "owned"
    attempts = [
        f"\\boxed{{__import__('os').system('touch {marker}')}}",
        "\\boxed{(2).n(100000)}",
        "\\boxed{x.evalf(100000)}",
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{10^{100000000}}",
        "\\boxed{" + "(" * 500 + "1" + ")" * 500 + "}",
    ]
    for text in attempts:
        assert score(text, "1") == 0.0
    assert not marker.exists()


def test_without_sympy_numbers_still_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sympy", None)  # what an environment without sympy looks like
    assert answers_match("\\frac{1}{2}", "0.5")
    assert answers_match("1,000", "1000")
    assert not answers_match("2\\sqrt{2}", "\\sqrt{8}")


def test_no_label_is_a_data_error() -> None:
    with pytest.raises(DataError, match="reward 'math' needs a label"):
        math_reward(Sample(prompt=Prompt(index=0, prompt="q"), response_text="7"))
