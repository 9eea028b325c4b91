"""The registry (names, unknown names, conflicts) and the family's own guards against bad input."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
from typing import Any

import pytest

from miles_envs.families import (
    FamilyError,
    ModelFamily,
    check_family_name,
    get_family,
    register_family,
    registered_families,
    registry,
)
from miles_envs.families.base import TemplateEdit


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    registered_families()  # built-ins in, then work on a copy
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))


def test_builtin_names() -> None:
    assert registered_families() == [
        "deepseek-v3.1",
        "generic",
        "glm-4.7",
        "glm-5",
        "kimi-k2.6",
        "minimax-m2",
        "minimax-m3",
        "nemotron-3",
        "qwen2.5",
        "qwen3",
        "qwen3.5",
    ]


def test_unknown_name_is_an_error_with_did_you_mean() -> None:
    with pytest.raises(FamilyError) as info:
        get_family("qwen")
    message = str(info.value)
    assert "model family 'qwen' is not registered; did you mean 'qwen3'?" in message
    assert "qwen3, qwen3.5" in message and "glm-5" in message  # names the registered families
    with pytest.raises(FamilyError, match="'llama-4-maverick' is not registered"):
        check_family_name("llama-4-maverick")
    # The generic family is still there, but only under its own name.
    assert get_family("generic").name == "generic" and check_family_name("generic") == "generic"


def test_recipe_with_a_misspelt_family_fails_validation() -> None:
    from miles.config import load_recipe
    from miles.config.loader import RecipeError

    agentic = ["rollout.generate_fn=multi_turn"]
    with pytest.raises(RecipeError) as info:
        load_recipe("default", [*agentic, "agentic.family=qwen"])
    assert "agentic.family (--set agentic.family=qwen)" in str(info.value)
    assert "did you mean 'qwen3'?" in str(info.value)
    assert load_recipe("default", [*agentic, "agentic.family=qwen3"]).agentic.family == "qwen3"
    assert load_recipe("default", [*agentic, "agentic.family=generic"]).agentic.family == "generic"


def test_family_a_plugin_registered_passes_validation(scratch_registry: None) -> None:
    from miles.config import load_recipe

    mine = dataclasses.replace(get_family("qwen2.5"), name="my-model")
    register_family("my-model", mine)
    config = load_recipe("default", ["rollout.generate_fn=multi_turn", "agentic.family=my-model"])
    assert config.agentic.family == "my-model"


def test_register_family(scratch_registry: None) -> None:
    mine = dataclasses.replace(get_family("qwen2.5"), name="my-model")
    register_family("my-model", mine)
    assert get_family("my-model") is mine and "my-model" in registered_families()
    with pytest.raises(FamilyError, match="already registered"):
        register_family("my-model", mine)
    other = dataclasses.replace(mine, description="v2")
    register_family("my-model", other, replace=True)
    assert get_family("my-model") is other
    with pytest.raises(FamilyError, match="calls itself"):
        register_family("alias", mine)
    with pytest.raises(FamilyError, match="expected a ModelFamily"):
        register_family("x", object())  # type: ignore[arg-type]
    shadow = dataclasses.replace(get_family("qwen3"), description="mine")
    with pytest.raises(FamilyError, match="'qwen3' is already registered"):
        register_family("qwen3", shadow)  # a built-in name needs replace=True
    register_family("qwen3", shadow, replace=True)
    assert get_family("qwen3") is shadow


def test_family_definition_is_validated() -> None:
    with pytest.raises(ValueError, match="exactly one of turn_end and next_role_stops"):
        ModelFamily(name="x")
    with pytest.raises(ValueError, match="no reasoning parser"):
        ModelFamily(name="x", turn_end="</s>", thinking="switch")


def test_light_imports() -> None:
    code = (
        "import sys\n"
        "import miles_envs.families, miles_envs.families.check, miles_envs.families.builtin, miles_envs.cli.families\n"
        "miles_envs.families.get_family('qwen3')\n"
        "print(sorted({'torch', 'transformers', 'tokenizers', 'jinja2'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- bad input to a family: one clear error before any heavy work


@pytest.fixture(scope="module")
def qwen3(tokenizer_of: Any) -> tuple[Any, Any]:
    return get_family("qwen3"), tokenizer_of("qwen3")


def test_bad_messages(qwen3: tuple[Any, Any]) -> None:
    family, tokenizer = qwen3
    with pytest.raises(FamilyError, match="message 0: expected a mapping"):
        family.render_ids(tokenizer, [{"content": "no role"}])
    bad_args = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
    }
    with pytest.raises(FamilyError, match="message 1: tool call 'f' arguments are not JSON"):
        family.render_ids(tokenizer, [{"role": "user", "content": "hi"}, bad_args])
    with pytest.raises(FamilyError, match="needs a 'function' object"):
        family.render_ids(tokenizer, [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}])


def test_thinking_switch_is_checked(tokenizer_of: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(FamilyError, match="always reasons"):
        get_family("minimax-m2").render_ids(tokenizer_of("minimax-m2"), messages, enable_thinking=False)
    with pytest.raises(FamilyError, match="has no reasoning mode"):
        get_family("qwen2.5").render_ids(tokenizer_of("qwen2.5"), messages, enable_thinking=True)


def test_suffix_rejects_roles_the_family_cannot_append(tokenizer_of: Any) -> None:
    family = get_family("qwen3.5")
    with pytest.raises(FamilyError, match=re.escape("role 'system' cannot be appended in family 'qwen3.5'")):
        family.suffix_ids(tokenizer_of("qwen3.5"), [{"role": "system", "content": "x"}])
    with pytest.raises(FamilyError, match="at least one new message"):
        family.suffix_ids(tokenizer_of("qwen3.5"), [])


def test_glm_suffix_checks_the_engine_s_stop_token(tokenizer_of: Any) -> None:
    family, tokenizer = get_family("glm-5"), tokenizer_of("glm-5")
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    observation = tokenizer.convert_tokens_to_ids("<|observation|>")
    new = [{"role": "user", "content": "next"}]
    suffix = family.suffix_ids(tokenizer, new, stop_id=user)
    assert (
        tokenizer.decode(suffix) == "next<|assistant|><think>"
    )  # the <|user|> the model emitted is not repeated
    with pytest.raises(
        FamilyError,
        match=re.escape("stopped with '<|observation|>' but the next message begins with '<|user|>'"),
    ):
        family.suffix_ids(tokenizer, new, stop_id=observation)


def test_a_foreign_template_is_refused_and_an_unverified_one_warned(
    tokenizer_of: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = tokenizer_of("qwen3")
    foreign = dataclasses.replace(get_family("qwen3"), chat_template="{{ messages[0].content }}")
    with pytest.raises(FamilyError, match="not the one the family was written for"):
        foreign.render_text(tokenizer, [{"role": "user", "content": "hi"}])
    family = get_family("qwen3")
    unverified = dataclasses.replace(
        family,
        name="qwen3-unverified-test",
        template_edits=(*family.template_edits, TemplateEdit("# Tools", "# Functions", "test")),
    )
    with caplog.at_level(logging.WARNING, logger="miles_envs.families.base"):
        unverified.render_text(tokenizer, [{"role": "user", "content": "hi"}])
        unverified.render_text(tokenizer, [{"role": "user", "content": "hi"}])
    warnings = [
        r.getMessage() for r in caplog.records if "not one the append-only check passed on" in r.getMessage()
    ]
    assert len(warnings) == 1 and "qwen3-unverified-test" in warnings[0]


def test_suffix_cost_does_not_depend_on_history(tokenizer_of: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """suffix_ids renders the anchor plus the new messages only, however long the conversation;
    the ids it returns still match rendering a 40-turn conversation whole."""
    family, tokenizer = get_family("qwen3"), tokenizer_of("qwen3")
    rendered_lengths: list[int] = []
    original = family.__class__.render_text

    def spy(self: Any, tok: Any, messages: Any, *args: Any, **kwargs: Any) -> str:
        rendered_lengths.append(len(messages))
        return original(self, tok, messages, *args, **kwargs)

    history: list[dict[str, Any]] = [{"role": "user", "content": "turn 0"}]
    ids = family.render_ids(tokenizer, history, enable_thinking=False)
    monkeypatch.setattr(family.__class__, "render_text", spy)
    for turn in range(40):
        reply = {"role": "assistant", "content": f"answer {turn}"}
        reply_ids = tokenizer.encode(f"answer {turn}<|im_end|>", add_special_tokens=False)
        new = [{"role": "user", "content": f"turn {turn + 1}"}]
        ids += reply_ids + family.suffix_ids(tokenizer, new, enable_thinking=False, previous=reply)
        history += [reply, *new]
    assert set(rendered_lengths) == {3}  # anchor (2) + one new message, at every turn
    monkeypatch.undo()
    assert ids == family.render_ids(tokenizer, history, enable_thinking=False)
