"""The tiny models' tokenizer: digits are single tokens, ChatML template, everything round-trips."""

from __future__ import annotations

import json

import pytest

from miles.builtins.data.files import builtin_dataset

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    from miles.models.tokenizer import build_tokenizer

    return build_tokenizer()


def test_special_tokens_and_size(tok) -> None:
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert 200 <= len(tok) <= 512


def test_every_digit_is_one_token_even_inside_numbers(tok) -> None:
    digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert len(set(digit_ids)) == 10
    assert tok.encode("1234567890", add_special_tokens=False) == [digit_ids[int(c)] for c in "1234567890"]
    assert tok.encode("x=42.", add_special_tokens=False)[2:4] == [digit_ids[4], digit_ids[2]]


def test_builtin_dataset_round_trips(tok) -> None:
    lines = builtin_dataset("arith").read_text().splitlines()
    for line in lines:
        record = json.loads(line)
        for text in (record["prompt"], record["label"]):
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert len(tok.encode(record["label"], add_special_tokens=False)) == 1


@pytest.mark.parametrize("text", ["héllo wörld ✓ 🙂", "  two  spaces\n\n\ttab", "\\boxed{\\frac{1}{2}}", ""])
def test_arbitrary_text_round_trips(tok, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chatml_template(tok) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "3+4="},
    ]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n3+4=<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages[1:], tokenize=False) == "<|im_start|>user\n3+4=<|im_end|>\n"
    rendered = tok.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 1  # the markers are single special tokens
    assert tok.decode(ids) == rendered


def test_assistant_mask_covers_the_reply_and_its_end_marker(tok) -> None:
    messages = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    out = tok.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(masked) == "7<|im_end|>"


def test_template_rejects_unknown_roles_and_late_system(tok) -> None:
    with pytest.raises(Exception, match="unsupported chat role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)
    with pytest.raises(Exception, match="first message"):
        tok.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], tokenize=False
        )
