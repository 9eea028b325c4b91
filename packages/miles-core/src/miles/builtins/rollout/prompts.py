"""Turning a prompt into the token ids the engine sees.

The tokenizer (and so the model family's chat template) owns the rendering; the
engine only ever receives ``input_ids``, so the tokens the trainer sees are the
tokens the engine sampled from, by construction.
"""

from __future__ import annotations

from typing import Any

from miles.types import Prompt


def render_prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    if isinstance(prompt.prompt, str):
        return list(tokenizer.encode(prompt.prompt, add_special_tokens=False))
    rendered = tokenizer.apply_chat_template(prompt.prompt, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True).
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(t) for t in ids]
