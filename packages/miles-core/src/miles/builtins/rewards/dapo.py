"""DAPO-style answer score: +1.0 when the ``Answer:`` at the end of the response equals the label, else -1.0.

DAPO's math prompts ask the model to finish with a line ``Answer: <answer>``, and the
score checks that line only, so the output format is part of what is rewarded:

1. Only the last ``TAIL_CHARS`` (300) characters are read. The answer must come at the
   end; an ``Answer:`` inside a long chain of thought, or a response cut off before it
   gave one, does not count; nor does anything inside ``<think>...</think>`` (or after an
   unclosed ``<think>``), wherever it is.
2. The answer is the rest of the line after the last ``Answer:`` there (case-insensitive,
   also ``**Answer:**`` and ``Final answer:``). No such line scores -1.0.
3. The answer and the label are normalized alike: markdown ``*`` around the answer and a
   ``\\boxed{...}`` around it are removed, then the ``math`` reward's rules apply (``$``,
   ``\\text{}``-style wrappers, ``\\left``/``\\right``, LaTeX spacing, ``%``, degrees, all
   whitespace, a leading ``x =`` and a trailing period are dropped; ``\\dfrac`` is ``\\frac``).
4. Two answers are equal when their normalized text is, or when both are exact numbers
   with the same value (``1,000`` = ``1000``, ``3.0`` = ``3``, ``0.5`` = ``1/2`` =
   ``\\frac{1}{2}``; compared as fractions, so ``0.333`` is not ``1/3``).

Deliberately strict: no symbolic equivalence (``2\\sqrt{2}`` is not ``\\sqrt{8}``; use the
``math`` reward for that) and no unit stripping (``5 cm`` is not ``5``). The DAPO data
set's labels are integers, and a strict check cannot be gamed by a verbose answer.
"""

from __future__ import annotations

import re

from miles.builtins.rewards.labels import require_label
from miles.builtins.rewards.math import last_boxed, normalize, to_number
from miles.builtins.rewards.reasoning import strip_reasoning
from miles.types import Sample

CORRECT = 1.0
INCORRECT = -1.0
TAIL_CHARS = 300

# "Answer:" as a word, optionally bold ("**Answer:**"), up to the end of its line.
_ANSWER_LINE = re.compile(r"(?i:\banswer)\s*(?:\*\*)?\s*:(?:\*\*)?[ \t]*([^\n]*)")


def dapo_reward(sample: Sample) -> float:
    """+1.0 if the response's final ``Answer:`` line equals ``sample.prompt.label``, else -1.0."""
    label = require_label(sample, "dapo")
    predicted = extract_answer(sample.response_text)
    if predicted is None:
        return INCORRECT
    return CORRECT if same_answer(predicted, label) else INCORRECT


def extract_answer(text: str) -> str | None:
    """The text after the last ``Answer:`` in the last ``TAIL_CHARS`` visible characters, or None."""
    found = _ANSWER_LINE.findall(strip_reasoning(text)[-TAIL_CHARS:])
    if not found:
        return None
    answer = found[-1].strip()
    return answer or None


def normalize_answer(answer: str) -> str:
    """The comparable form of an answer (rules 3 above)."""
    s = answer.strip().strip("*").strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    return normalize(s)


def same_answer(predicted: str, label: str) -> bool:
    a, b = normalize_answer(predicted), normalize_answer(label)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    return x is not None and x == y
