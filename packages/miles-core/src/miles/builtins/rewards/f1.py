"""SQuAD-style token F1 between the response's answer and the label (partial credit in [0, 1]).

Both texts are normalized (lowercase; punctuation removed; the articles ``a``, ``an``,
``the`` removed; whitespace collapsed) and split on whitespace. With ``common`` the
size of the multiset intersection of the two token lists::

    precision = common / len(predicted)     recall = common / len(gold)
    F1        = 2 * precision * recall / (precision + recall)     (0 when common == 0)

If either side has no tokens after normalization, F1 is 1.0 when both are empty and 0.0
otherwise (SQuAD v2's convention for "no answer").

The answer is read from what follows the last ``</think>`` (the whole response when there
is none: reasoning is never scored), in this order: the last ``<answer>...</answer>``, else
the last ``\\boxed{...}`` (``\\text{}`` wrappers removed), else the rest of the line after
the last ``Answer:``, else all of it.

Several acceptable answers: a label that is a JSON array of strings
(``["Denver Broncos", "Broncos"]``) lists alternatives and the reward is the best F1
over them; any other label is one answer. Data sources keep labels as strings, so a
data set with a list of answers stores it JSON-encoded.
"""

from __future__ import annotations

import json
import re
import string
import unicodedata
from collections import Counter

from miles.builtins.rewards.labels import require_label
from miles.builtins.rewards.math import last_boxed
from miles.errors import DataError
from miles.types import Sample

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_LINE = re.compile(r"(?i:\banswer)\s*(?:\*\*)?\s*:(?:\*\*)?[ \t]*([^\n]*)")
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_END_OF_THINKING = "</think>"
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf)\{([^{}]*)\}")


def f1_reward(sample: Sample) -> float:
    """The best token F1 of the response's answer against the label's acceptable answers."""
    label = require_label(sample, "f1")
    answers = acceptable_answers(label, sample.prompt.index)
    predicted = extract_answer(sample.response_text)
    return max(token_f1(predicted, gold) for gold in answers)


def acceptable_answers(label: str, prompt_index: int = 0) -> list[str]:
    """``label`` as a list of alternatives: a JSON array of strings, else ``[label]``."""
    if not label.lstrip().startswith("["):
        return [label]
    try:
        parsed = json.loads(label)
    except json.JSONDecodeError:
        return [label]  # e.g. "[citation needed]": plain text that happens to start with a bracket
    if not isinstance(parsed, list) or not all(isinstance(a, str) for a in parsed):
        return [label]
    if not parsed:
        raise DataError(
            f"reward 'f1': the label of prompt {prompt_index} is an empty JSON list; "
            "give at least one acceptable answer"
        )
    return parsed


def extract_answer(response: str) -> str:
    """The part of the response that is scored (see the module docstring for the order)."""
    response = response.rsplit(_END_OF_THINKING, 1)[-1]
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1]
    boxed = last_boxed(response)
    if boxed is not None:
        return _LATEX_TEXT.sub(r"\1", boxed)  # \boxed{\text{Paris}} -> Paris
    lines = _ANSWER_LINE.findall(response)
    if lines:
        return lines[-1]
    return response


def normalize_text(text: str) -> str:
    """Lowercase, drop punctuation (ASCII and Unicode) and English articles, collapse whitespace."""
    # Removed, not replaced by a space: "U.S." becomes "us", as in SQuAD's evaluation script.
    text = "".join(ch for ch in text.lower() if not _is_punctuation(ch))
    return " ".join(_ARTICLES.sub(" ", text).split())


def _is_punctuation(ch: str) -> bool:
    # ASCII punctuation includes symbols such as $ and +; Unicode adds curly quotes and dashes.
    return ch in string.punctuation or unicodedata.category(ch).startswith("P")


def token_f1(predicted: str, gold: str) -> float:
    """Token F1 of two texts after ``normalize_text``."""
    pred_tokens = normalize_text(predicted).split()
    gold_tokens = normalize_text(gold).split()
    if not pred_tokens or not gold_tokens:
        return 1.0 if pred_tokens == gold_tokens else 0.0
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)
