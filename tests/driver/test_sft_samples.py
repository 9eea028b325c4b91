"""SFT samples: the loss covers exactly the assistant's tokens, with real chat templates."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from miles.driver.sft import conversation_sample
from miles.errors import DataError
from miles.models.registry import resolve_model
from miles.types import Prompt

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "3+4="},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "and 2+2="},
    {"role": "assistant", "content": "4, easy"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen3"))


def _spans(sample) -> list[str]:
    """The trained text, one string per maximal run of mask-1 tokens."""
    spans, current = [], []
    for token, m in zip(sample.response_ids, sample.loss_mask, strict=True):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def test_only_assistant_turns_are_trained(tokenizer) -> None:
    sample = conversation_sample(tokenizer, Prompt(index=0, prompt=CONVERSATION), max_length=512)
    assert sample is not None
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(sample.prompt_ids + sample.response_ids) == full
    texts = [tokenizer.decode(span) for span in _spans(sample)]
    # ChatML: each assistant turn is "content<|im_end|>\n"; the "<|im_start|>assistant\n" header is context.
    assert texts == ["7<|im_end|>\n", "4, easy<|im_end|>\n"]
    # The prompt ends right where the first assistant turn starts.
    assert tokenizer.decode(sample.prompt_ids).endswith("<|im_start|>assistant\n")
    sample.check_aligned()


def test_truncation_keeps_what_fits_and_drops_conversations_with_nothing_left(tokenizer) -> None:
    whole = conversation_sample(tokenizer, Prompt(index=0, prompt=CONVERSATION), max_length=512)
    assert whole is not None
    cut = len(whole.prompt_ids) + 2
    sample = conversation_sample(tokenizer, Prompt(index=0, prompt=CONVERSATION), max_length=cut)
    assert sample is not None and sample.total_length == cut
    assert sample.loss_mask == whole.loss_mask[:2]
    assert (
        conversation_sample(tokenizer, Prompt(index=0, prompt=CONVERSATION), max_length=len(whole.prompt_ids))
        is None
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("plain text", "expected a list of chat messages"),
        ([{"role": "user", "content": "hi"}], "no assistant message"),
        ([{"role": "assistant", "content": "hi"}], "starts with an assistant message"),
    ],
)
def test_bad_conversations_are_refused_with_their_index(tokenizer, messages, match) -> None:
    with pytest.raises(DataError, match=f"SFT conversation 5: {match}"):
        conversation_sample(tokenizer, Prompt(index=5, prompt=messages), max_length=64)


def test_a_template_that_rewrites_history_is_refused(tokenizer) -> None:
    # Like templates that drop earlier reasoning: only the last assistant turn is rendered.
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen3"))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(DataError, match="not append-only around assistant message 2"):
        conversation_sample(tokenizer, Prompt(index=1, prompt=CONVERSATION), max_length=512)
