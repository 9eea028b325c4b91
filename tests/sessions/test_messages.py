"""Message normalisation: what a template reads is kept, client noise is dropped, bad input refused."""

from __future__ import annotations

import pytest

from miles_envs.sessions import Message, MessageError, ToolCall, parse_messages


def test_empty_content_forms_are_one_and_unknown_keys_are_dropped() -> None:
    a = Message.from_openai({"role": "assistant", "content": None, "refusal": None, "annotations": []})
    b = Message.from_openai({"role": "assistant", "content": ""})
    c = Message.from_openai({"role": "assistant", "content": [], "tool_calls": None})
    assert a == b == c == Message(role="assistant")


def test_tool_calls_drop_the_wire_index_and_default_their_type() -> None:
    raw = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    msg = Message.from_openai(raw)
    assert msg.tool_calls == (ToolCall(name="f", arguments='{"a": 1}', id="c1", type="function"),)
    assert msg.to_openai()["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]


def test_reasoning_alias_text_parts_and_round_trip() -> None:
    msg = Message.from_openai(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert msg.content == ("a", "b") and msg.text == "ab"
    assert Message.from_openai(msg.to_openai()) == msg
    thought = Message.from_openai({"role": "assistant", "content": "x", "reasoning": "why"})
    assert thought.reasoning_content == "why"
    assert Message.from_openai(thought.to_openai()) == thought


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"role": "robot", "content": "x"}, "role must be one of"),
        ({"content": "x"}, "role must be one of"),
        ({"role": "user", "content": 3}, "content must be a string"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "text only"),
        ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "only assistant"),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "function.name"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}, "arguments"),
        ({"role": "assistant", "tool_calls": {"function": {"name": "f"}}}, "tool_calls must be a list"),
        ({"role": "tool", "content": "x", "tool_call_id": 7}, "tool_call_id must be a string"),
    ],
)
def test_bad_messages_are_refused_with_their_index(raw: dict, needle: str) -> None:
    with pytest.raises(MessageError, match=needle) as info:
        parse_messages([{"role": "user", "content": "ok"}, raw])
    assert info.value.index == 1 and str(info.value).startswith("message 1:")


def test_messages_must_be_a_list_of_objects() -> None:
    with pytest.raises(MessageError, match="must be a list"):
        parse_messages("hello")
    with pytest.raises(MessageError, match="message 0: must be an object"):
        parse_messages(["hello"])
