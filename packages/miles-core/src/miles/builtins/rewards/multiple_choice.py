"""Multiple-choice reward: 1.0 when the letter the response settles on is the label's letter, else 0.0.

Only the visible response is read: ``<think>...</think>`` reasoning is removed first, and a
response cut off inside an unclosed ``<think>`` has no answer (``reasoning.strip_reasoning``).
A letter counts only when the response states it as its answer, in one of these forms:

- an answer statement: ``Answer: C``, ``The answer is (C)``, ``the correct option is C.``,
  ``**Final answer:** C``, ``Answer: Option C`` (``answer``/``option``/``choice``, then
  ``is`` and/or ``:``, then the letter, optionally in ``( )``, ``[ ]``, ``**``, ``$``);
- a box: ``\\boxed{C}``, ``\\boxed{(C)}``, ``\\boxed{\\text{C}}``;
- a last non-empty line that is only the letter: ``C``, ``C.``, ``(C)``, ``**C**``.

When the response states several, the last one wins (models often correct themselves;
a last statement naming a letter outside ``choices`` scores 0.0), and letters merely
mentioned (``option A is wrong``) never count. Letters must be
uppercase: a lowercase ``a`` is far more often the article. ``I`` followed by a lowercase
word is the pronoun (``the answer is I think B``), not the letter. A response with no
stated letter scores 0.0.

The label is one letter, optionally as ``(C)``, ``C.`` or lowercase. Options:
``choices`` (default ``"ABCDEFGHIJ"``): the valid letters; a label outside them is a
data error, so a 5-option data set with ``choices: ABCD`` fails loudly instead of
scoring 0.
"""

from __future__ import annotations

import re

from pydantic import Field

from miles.builtins.rewards.labels import require_label
from miles.builtins.rewards.reasoning import strip_reasoning
from miles.capabilities import ComponentOptions
from miles.errors import ConfigError, DataError
from miles.types import Sample

DEFAULT_CHOICES = "ABCDEFGHIJ"

_LABEL = re.compile(r"[(\[]?\s*([A-Za-z])\s*[)\]]?[.:]?")

# Any capital letter is read, and checked against ``choices`` only once the last statement is
# known, so a final "Answer: E" with choices ABCD is an invalid answer rather than a reason to
# fall back to an earlier statement.
_LETTER = "([A-Z])"
# Not followed by a letter or digit ("Apple", "A1"), and not the pronoun "I" before a word.
_END = r"(?![A-Za-z0-9])(?!(?<=I)\s+[a-z])"
_STATEMENT = re.compile(
    r"(?i:\b(?:answer|option|choice)\b)"
    r"(?:\s*(?:(?i:is)\b|:)){1,2}"  # "is", ":", or "is:"
    r"[\s*_$(\[]*(?i:(?:option|choice)\s+)?[\s*_$(\[]*" + _LETTER + _END
)
_BOXED = re.compile(r"\\boxed\{\s*(?:\\text(?:bf)?\{\s*)?[(\[]?\s*" + _LETTER + r"\s*[)\]]?\s*\}")
_BARE_LINE = re.compile(r"[\s*_(\[]*" + _LETTER + r"[\s*_)\].:]*")


class MultipleChoiceOptions(ComponentOptions):
    choices: str = Field(DEFAULT_CHOICES, description="the answer letters, distinct uppercase (e.g. ABCD)")


class MultipleChoiceReward:
    """Scores ``sample.response_text`` against the letter in ``sample.prompt.label``."""

    Options = MultipleChoiceOptions

    def __init__(self, choices: str = DEFAULT_CHOICES) -> None:
        if (
            not isinstance(choices, str)
            or not choices
            or not all("A" <= c <= "Z" for c in choices)
            or len(set(choices)) != len(choices)
        ):
            raise ConfigError(
                f"reward 'multiple_choice': choices must be distinct uppercase letters such as 'ABCD', "
                f"got {choices!r}"
            )
        self.choices = choices

    def __call__(self, sample: Sample) -> float:
        expected = self.label_letter(require_label(sample, "multiple_choice"), sample.prompt.index)
        return 1.0 if self.extract(sample.response_text) == expected else 0.0

    def extract(self, response: str) -> str | None:
        """The last letter the response states as its answer outside its reasoning, or None."""
        response = strip_reasoning(response)
        # (position, letter) of every statement; the largest position is the final word.
        found = [(m.start(1), m.group(1)) for m in _STATEMENT.finditer(response)]
        found += [(m.start(1), m.group(1)) for m in _BOXED.finditer(response)]
        stripped = response.rstrip()
        last_line_start = stripped.rfind("\n") + 1
        bare = _BARE_LINE.fullmatch(stripped, last_line_start)
        if bare is not None:
            found.append((bare.start(1), bare.group(1)))
        if not found:
            return None
        chosen = max(found)[1]
        return chosen if chosen in self.choices else None

    def label_letter(self, label: str, prompt_index: int) -> str:
        m = _LABEL.fullmatch(label.strip())
        letter = m.group(1).upper() if m else None
        if letter is None or letter not in self.choices:
            raise DataError(
                f"reward 'multiple_choice': the label {label!r} of prompt {prompt_index} is not one of the "
                f"letters {self.choices}; labels are one letter (e.g. 'C'), and "
                "rollout.reward_options.choices sets the valid letters"
            )
        return letter


# The entry point names a class, so ``rollout.reward_options`` (e.g. ``choices``) reach its constructor.
multiple_choice_reward = MultipleChoiceReward
