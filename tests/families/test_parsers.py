"""Reasoning and tool-call parsers on crafted replies (text level), and parse_reply on real ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from miles_envs.families.parsers import (
    DeepSeekToolParser,
    GlmToolParser,
    JsonTagToolParser,
    KimiToolParser,
    MiniMaxToolParser,
    ReasoningParser,
    XmlFunctionToolParser,
    coerce_value,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "exact": {"type": "boolean"},
                    "opts": {"type": "object"},
                },
            },
        },
    }
]


def calls(parse: Any) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parse.calls]


def test_openai_shape() -> None:
    [call] = (
        JsonTagToolParser()
        .parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None)
        .calls
    )
    assert set(call) == {"id", "type", "function"} and call["type"] == "function"
    assert call["id"].startswith("call_") and isinstance(call["function"]["arguments"], str)


def test_json_tag_single_parallel_and_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": "{\\"x\\": [1, 2]}"}\n</tool_call>'
    )
    parse = JsonTagToolParser().parse(text, None)
    assert parse.errors == [] and parse.content == "Let me check."
    assert calls(parse) == [("f", {"city": "Paris"}), ("g", {"x": [1, 2]})]
    assert JsonTagToolParser().parse("just text", None).calls == []


def test_json_tag_malformed_keeps_the_block_and_says_why() -> None:
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> <tool_call>{"name": "g"}</tool_call>'
    parse = JsonTagToolParser().parse(text, None)
    assert calls(parse) == [("g", {})]
    assert len(parse.errors) == 1 and "tool call 1: invalid JSON" in parse.errors[0]
    assert '{"name": "f", "arguments": {"a": 1}' in parse.content  # left visible, not dropped
    unclosed = JsonTagToolParser().parse('<tool_call>{"name": "f"}', None)
    assert unclosed.calls == [] and "no closing" in unclosed.errors[0]
    not_object = JsonTagToolParser().parse('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None)
    assert "must be a JSON object" in not_object.errors[0]


def test_xml_function_uses_the_schema_types() -> None:
    text = (
        "<tool_call>\n<function=f>\n<parameter=city>\n3\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        '<parameter=opts>\n{"a": [1]}\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=g>\n<parameter=note>\ntwo\nlines\n</parameter>\n</function>\n</tool_call>"
    )
    parse = XmlFunctionToolParser().parse(text, TOOLS)
    assert parse.errors == []
    assert calls(parse) == [
        ("f", {"city": "3", "days": 3, "opts": {"a": [1]}, "exact": True}),
        ("g", {"note": "two\nlines"}),
    ]
    bad = XmlFunctionToolParser().parse("<tool_call>\n<func=f>\n</tool_call>", TOOLS)
    assert bad.calls == [] and "expected <function=NAME>" in bad.errors[0]


def test_glm() -> None:
    text = "Sure.<tool_call>f<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>g</tool_call>"
    parse = GlmToolParser().parse(text, TOOLS)
    assert parse.content == "Sure." and calls(parse) == [("f", {"city": "Paris", "days": 2}), ("g", {})]
    bad = GlmToolParser().parse('<tool_call>{"name": "f"}</tool_call>', TOOLS)
    assert bad.calls == [] and "function name" in bad.errors[0]
    unpaired = GlmToolParser().parse("<tool_call>f<arg_key>a</arg_key></tool_call>", TOOLS)
    assert "unpaired" in unpaired.errors[0]


def test_minimax() -> None:
    text = (
        'Checking.\n<minimax:tool_call>\n<invoke name="f">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="g">\n</invoke>\n</minimax:tool_call>'
    )
    parse = MiniMaxToolParser().parse(text, TOOLS)
    assert parse.errors == [] and parse.content == "Checking."
    assert calls(parse) == [("f", {"city": "Paris", "days": 2}), ("g", {})]
    bad = MiniMaxToolParser().parse(
        "<minimax:tool_call>\n<invoke name=f>\n</invoke>\n</minimax:tool_call>", TOOLS
    )
    assert bad.calls == [] and bad.errors


def test_deepseek_formats() -> None:
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert calls(DeepSeekToolParser().parse(v31, None)) == [("f", {"city": "Paris"}), ("g", {})]
    r1 = 'Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    parse = DeepSeekToolParser(fenced=True).parse(r1, None)
    assert parse.content == "Hi" and calls(parse) == [("f", {"a": 1})]
    bad = DeepSeekToolParser().parse(
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        None,
    )
    assert bad.calls == [] and "invalid JSON" in bad.errors[0]


def test_kimi_keeps_the_model_s_call_id() -> None:
    text = '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
    [call] = KimiToolParser().parse(text, None).calls
    assert call["id"] == "functions.get_weather:3" and call["function"]["name"] == "get_weather"
    bad = KimiToolParser().parse(text.replace("functions.get_weather:3", "nonsense"), None)
    assert bad.calls == [] and "functions.NAME:INDEX" in bad.errors[0]


def test_reasoning_parser() -> None:
    plain = ReasoningParser()
    assert plain.split("<think>\nR\n</think>\n\nC", thinking=True) == ("R", "C")
    assert plain.split("just C", thinking=True) == (None, "just C")  # the model chose not to think
    opened = ReasoningParser(opened_by_prompt=True)
    assert opened.split("R\n</think>\n\nC", thinking=True) == ("R", "C")
    assert opened.split("C only", thinking=False) == (None, "C only")
    assert opened.split("cut off mid-thou", thinking=True) == ("cut off mid-thou", "")  # length limit
    lenient = ReasoningParser(opened_by_prompt=True, unclosed_is_reasoning=False)
    assert lenient.split("answer after a tool result", thinking=True) == (None, "answer after a tool result")


def test_coerce_value() -> None:
    assert coerce_value("3", "string") == "3"
    assert coerce_value("3", "integer") == 3
    assert coerce_value("3", None) == 3
    assert coerce_value("Paris", None) == "Paris"
    assert coerce_value("False", "boolean") is False


@pytest.fixture(scope="module")
def qwen3(tokenizer_of: Any) -> tuple[Any, Any]:
    from miles_envs.families import get_family

    return get_family("qwen3"), tokenizer_of("qwen3")


def test_parse_reply_on_real_ids(qwen3: tuple[Any, Any]) -> None:
    family, tokenizer = qwen3
    text = '<think>\nCheck the weather.\n</think>\n\nOne moment.\n<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    reply = family.parse_reply(tokenizer, ids, enable_thinking=True, tools=TOOLS)
    assert (reply.status, reply.stopped, reply.reasoning_content, reply.content) == (
        "ok",
        True,
        "Check the weather.",
        "One moment.",
    )
    assert [c["function"]["name"] for c in reply.tool_calls] == ["f"]
    message = reply.to_message()
    assert message["role"] == "assistant" and message["reasoning_content"] == "Check the weather."

    truncated = family.parse_reply(tokenizer, ids[:-1], enable_thinking=True)
    assert truncated.stopped is False

    broken = tokenizer.encode(
        '<tool_call>\n{"name": "f", "arguments": {\n</tool_call><|im_end|>', add_special_tokens=False
    )
    reply = family.parse_reply(tokenizer, broken, enable_thinking=False)
    assert (
        reply.status == "malformed_tool_call" and reply.tool_calls == [] and "invalid JSON" in reply.errors[0]
    )
    assert "<tool_call>" in reply.content


def test_stop_token_ids(qwen3: tuple[Any, Any], tokenizer_of: Any) -> None:
    from miles_envs.families import get_family

    family, tokenizer = qwen3
    assert tokenizer.convert_ids_to_tokens(family.stop_token_ids(tokenizer)) == [
        "<|im_end|>",
        "<|endoftext|>",
    ]
    glm = get_family("glm-5")
    glm_tok = tokenizer_of("glm-5")
    assert glm_tok.convert_ids_to_tokens(glm.stop_token_ids(glm_tok)) == [
        "<|user|>",
        "<|observation|>",
        "<|endoftext|>",
    ]
