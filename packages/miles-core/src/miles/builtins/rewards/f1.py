"""SQuAD-style token F1 between the response's answer and the label (partial credit in [0, 1]).

Both texts are normalized (lowercase; punctuation removed; the articles ``a``, ``an``,
``the`` removed; whitespace collapsed) and split on whitespace. With ``common`` the
size of the multiset intersection of the two token lists::

    precision = common / len(predicted)     recall = common / len(gold)
    F1        = 2 * precision * recall / (precision + recall)     (0 when common == 0)

A gold answer that normalization would erase entirely (``"A"``, ``"The"``, ``"?"``) is a real
answer, not "no answer": both sides are then normalized more lightly, first keeping the
articles, then also the punctuation (only case and whitespace are ignored), so label ``"A"``
matches ``"a."`` but not ``"the"`` or an empty response. A response with no tokens scores 0.0
against any gold answer that has some. Only a gold answer that is empty or whitespace is "no
answer" (SQuAD v2's convention): it scores 1.0 against an empty answer, 0.0 against any other.

The answer is read from the response without its ``<think>...</think>`` reasoning
(``reasoning.strip_reasoning``: reasoning is never scored, and a response cut off inside an
unclosed ``<think>`` has no answer), in this order: the last ``<answer>...</answer>``, else
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
from miles.builtins.rewards.reasoning import strip_reasoning
from miles.errors import DataError
from miles.types import Sample

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_LINE = re.compile(r"(?i:\banswer)\s*(?:\*\*)?\s*:(?:\*\*)?[ \t]*([^\n]*)")
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
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
    response = strip_reasoning(response)
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


def _keep_articles(text: str) -> str:
    return " ".join("".join(ch for ch in text.lower() if not _is_punctuation(ch)).split())


def _case_and_space(text: str) -> str:
    return " ".join(text.lower().split())


# From the SQuAD normalization to the lightest one: the first that leaves the gold answer a token wins.
_NORMALIZERS = (normalize_text, _keep_articles, _case_and_space)


def token_f1(predicted: str, gold: str) -> float:
    """Token F1 of two texts, both normalized by the first of ``_NORMALIZERS`` that keeps a gold token."""
    for normalizer in _NORMALIZERS:
        gold_tokens = normalizer(gold).split()
        if gold_tokens:
            break
    else:  # the gold answer is blank: "no answer", right only when the response gives none
        return 1.0 if not predicted.strip() else 0.0
    pred_tokens = normalizer(predicted).split()
    if not pred_tokens:
        return 0.0
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)
