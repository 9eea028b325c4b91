"""Greedy exact-answer rate of a Hugging Face model directory, without an engine.

For small models and prompt sets (the default recipe's 55 additions): every prompt rendered with
the model's chat template exactly as the JSONL data source renders it, decoded greedily with
``transformers``, and compared with its label the way the ``exact_match`` reward compares (the
whitespace-normalized answer equals the label). The run's own ``eval`` section measures the
live policy on the engines; this measures a saved policy (``final/``, ``warm_start/final/``)
on its own, so two stages of a run can be compared after the fact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from miles.types import Prompt


@dataclass(frozen=True)
class ExactRate:
    correct: int
    total: int
    answers: list[str]  # the decoded answers, in the data file's order

    @property
    def rate(self) -> float:
        return self.correct / self.total if self.total else 0.0


def greedy_exact_rate(
    model_dir: str, data_path: str = "builtin:arith", *, max_new_tokens: int = 4, batch_size: int = 64
) -> ExactRate:
    """Decode every ``{"prompt", "label"}`` row of ``data_path`` greedily with the model in ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.builtins.data.files import resolve_data_path
    from miles.builtins.rewards.exact_match import normalize_whitespace
    from miles.builtins.rollout.prompts import render_prompt_ids

    path = resolve_data_path(data_path)
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers: list[str] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        encoded = [render_prompt_ids(tokenizer, _chat_prompt(row["prompt"])) for row in chunk]
        width = max(len(ids) for ids in encoded)
        # Left padding: every row's next token is at the same position.
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        answers += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    correct = sum(
        normalize_whitespace(answer) == normalize_whitespace(str(row["label"]))
        for answer, row in zip(answers, rows, strict=True)
    )
    return ExactRate(correct, len(rows), answers)


def _chat_prompt(text: str) -> Prompt:
    """A prompt as the JSONL data source makes it from a plain string (one user message)."""
    return Prompt(index=0, prompt=[{"role": "user", "content": text}])
