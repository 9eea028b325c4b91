"""The visible part of a response: what is left once its ``<think>...</think>`` reasoning is removed.

Rewards grade the answer a model gives, never its reasoning: a letter, number or phrase that
appears only while the model was thinking ("maybe B? no...") is not an answer. Every built-in
reward that reads an answer out of free text calls ``strip_reasoning`` first, so they all agree
on what counts as reasoning:

- a closed ``<think>...</think>`` block is removed wherever it is;
- a ``</think>`` that closes nothing ends reasoning that the prompt opened (chat templates with
  thinking on write ``<think>`` into the generation prompt), so everything before it is reasoning;
- an unclosed ``<think>`` runs to the end of the response (the model was cut off, or never
  stopped thinking), so nothing after it is an answer.
"""

from __future__ import annotations

import re

THINK_START = "<think>"
THINK_END = "</think>"

_TAG = re.compile(re.escape(THINK_START) + "|" + re.escape(THINK_END))


def strip_reasoning(text: str) -> str:
    """``text`` without its reasoning (see the module docstring); ``""`` when it is all reasoning."""
    visible: list[str] = []
    depth = 0  # open <think> blocks at the current position
    position = 0
    for tag in _TAG.finditer(text):
        if depth == 0:
            visible.append(text[position : tag.start()])
        if tag.group() == THINK_START:
            depth += 1
        elif depth > 0:
            depth -= 1
        else:
            visible.clear()  # a stray </think>: the prompt opened the reasoning, all of it so far
        position = tag.end()
    if depth == 0:
        visible.append(text[position:])
    return "".join(visible)
