"""The replay matchers on crafted pairs: what each accepts and what it refuses."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from miles.errors import ComponentError
from miles_envs.sessions import MatcherError, Message, json_args, loose, resolve_matcher, strict
from miles_envs.sessions.matchers import differences

from .helpers import assistant


def call(arguments: object, *, call_id: str = "c1", name: str = "search") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def msg(*calls: dict, content: str = "", reasoning: str | None = "think") -> Message:
    raw: dict = {"role": "assistant", "content": content, "tool_calls": list(calls)}
    if reasoning is not None:
        raw["reasoning_content"] = reasoning
    return Message.from_openai(raw)


RECORDED = msg(call('{"query": "paris", "limit": 3, "opts": {"a": true, "b": null}}'))


@pytest.mark.parametrize(
    ("incoming", "strict_ok", "json_ok", "loose_ok"),
    [
        pytest.param(RECORDED, True, True, True, id="identical"),
        pytest.param(
            Message.from_openai({**RECORDED.to_openai(), "refusal": None, "audio": None}),
            True,
            True,
            True,
            id="client-only keys",
        ),
        pytest.param(
            msg(call('{"limit": 3, "opts": {"b": null, "a": true}, "query": "paris"}')),
            False,
            True,
            True,
            id="reordered JSON keys",
        ),
        pytest.param(
            msg(call('{ "query":"paris",\n "limit":3.0, "opts":{"a":true,"b":null} }')),
            False,
            True,
            True,
            id="re-serialised spacing and 3 as 3.0",
        ),
        pytest.param(
            msg(call({"query": "paris", "limit": 3, "opts": {"a": True, "b": None}})),
            False,
            True,
            True,
            id="arguments sent as an object",
        ),
        pytest.param(
            msg(call('{"query": "paris", "limit": 3, "opts": {"a": 1, "b": null}}')),
            False,
            False,
            True,
            id="true vs 1",
        ),
        pytest.param(
            msg(call('{"query": "lyon", "limit": 3, "opts": {"a": true, "b": null}}')),
            False,
            False,
            True,
            id="other args",
        ),
        pytest.param(
            msg(call('{"query": "paris", "limit": 3, "opts": {"a": true, "b": null}}', call_id="c2")),
            False,
            False,
            True,
            id="call id changed",
        ),
        pytest.param(
            msg(call('{"query": "paris", "limit": 3, "opts": {"a": true, "b": null}}', name="lookup")),
            False,
            False,
            True,
            id="function name changed",
        ),
        pytest.param(
            msg(call('{"query": "paris", "limit": 3, "opts": {"a": true, "b": null}}'), reasoning="other"),
            False,
            False,
            True,
            id="reasoning changed",
        ),
        pytest.param(
            msg(call('{"query": "paris", "limit": 3, "opts": {"a": true, "b": null}}'), reasoning=None),
            False,
            False,
            True,
            id="reasoning omitted on replay",
        ),
        pytest.param(msg(), False, False, True, id="tool calls dropped, same empty text"),
        pytest.param(
            msg(call('{"query": "paris", "limit": 3, "opts": {"a": true, "b": null}}'), content="hi"),
            False,
            False,
            False,
            id="visible text changed",
        ),
    ],
)
def test_matcher_table(incoming: Message, strict_ok: bool, json_ok: bool, loose_ok: bool) -> None:
    assert strict(RECORDED, incoming) is strict_ok
    assert json_args(RECORDED, incoming) is json_ok
    assert loose(RECORDED, incoming) is loose_ok


def test_json_args_keeps_the_order_of_calls() -> None:
    a, b = call('{"x": 1}', call_id="c1"), call('{"y": 2}', call_id="c2", name="other")
    assert json_args(msg(a, b), msg(a, b))
    assert not json_args(msg(a, b), msg(b, a))
    assert not json_args(msg(a, b), msg(a))


@pytest.mark.parametrize("absent", ["", "{}", " {} ", None, {}])
def test_json_args_treats_every_form_of_absent_arguments_as_the_empty_object(absent: object) -> None:
    assert json_args(msg(call("")), msg(call(absent)))
    assert json_args(msg(call("{}")), msg(call(absent)))
    assert not json_args(msg(call("{}")), msg(call('{"x": 1}')))


def test_json_args_falls_back_to_exact_text_for_what_is_not_plain_json() -> None:
    dup = '{"a": 1, "a": 2}'
    assert json_args(msg(call(dup)), msg(call(dup)))
    assert not json_args(msg(call(dup)), msg(call('{"a": 2}')))  # duplicate keys are never "the same value"
    assert not json_args(msg(call('{"a": NaN}')), msg(call('{"a":NaN}')))
    assert json_args(msg(call("not json")), msg(call("not json")))
    assert not json_args(msg(call("not json")), msg(call("not  json")))


def test_strict_compares_tool_and_name_fields() -> None:
    t = Message.from_openai({"role": "tool", "tool_call_id": "c1", "content": "21"})
    assert strict(t, Message.from_openai({"role": "tool", "tool_call_id": "c1", "content": "21"}))
    assert not strict(t, Message.from_openai({"role": "tool", "tool_call_id": "c9", "content": "21"}))
    assert not strict(
        t, Message.from_openai({"role": "tool", "tool_call_id": "c1", "content": "21", "name": "f"})
    )
    assert not strict(t, Message.from_openai({"role": "user", "content": "21"}))


def test_strict_objects_compare_numbers_by_kind() -> None:
    assert strict(msg(call({"n": 1})), msg(call({"n": 1})))
    assert not strict(msg(call({"n": 1})), msg(call({"n": 1.0})))
    assert not strict(msg(call({"n": 1})), msg(call({"n": True})))
    assert not strict(msg(call({"n": 1})), msg(call('{"n": 1}')))  # an object is not its serialisation


def test_differences_name_the_fields() -> None:
    changed = msg(call('{"query": "lyon"}', call_id="c9"), reasoning=None)
    assert differences(RECORDED, changed) == [
        "reasoning_content",
        "tool_calls[0].id",
        "tool_calls[0].arguments",
    ]
    assert differences(RECORDED, msg()) == ["tool_calls (recorded 1 calls, got 0)"]
    assert differences(RECORDED, RECORDED) == []


# ----------------------------------------------------------------------- resolving


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's one-off module on sys.path, as a run would import it."""
    name = "my_session_matchers"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            def same_role(recorded, incoming):
                return recorded.role == incoming.role

            def not_a_bool(recorded, incoming):
                return "yes"

            def broken(recorded, incoming):
                raise KeyError("boom")

            class Prefix:
                def __init__(self, chars: int):
                    self.chars = chars

                def __call__(self, recorded, incoming):
                    return recorded.text[: self.chars] == incoming.text[: self.chars]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_matcher_by_import_path(user_module: str) -> None:
    match = resolve_matcher(f"{user_module}:same_role")
    assert match(RECORDED, msg(content="anything")) is True
    prefix = resolve_matcher(f"{user_module}:Prefix", {"chars": 2})
    a = Message.from_openai(assistant("hello"))
    assert prefix(a, Message.from_openai(assistant("help"))) and not prefix(
        a, Message.from_openai(assistant("ho"))
    )


def test_builtin_matchers_by_import_path() -> None:
    match = resolve_matcher("miles_envs.sessions.matchers:json_args")
    assert match(msg(call('{"a": 1, "b": 2}')), msg(call('{"b": 2, "a": 1}')))


@pytest.mark.parametrize("name", ["strict", "json_args", "loose"])
def test_builtin_matchers_by_name(name: str) -> None:
    """The built-ins are entry points of miles-core, like any plugin's matcher."""
    assert resolve_matcher(name)(RECORDED, RECORDED) is True
    with pytest.raises(ComponentError, match="did you mean 'json_args'"):
        resolve_matcher("json_arg")


def test_misbehaving_matchers_fail_clearly(user_module: str) -> None:
    with pytest.raises(MatcherError, match="must return a bool, returned str"):
        resolve_matcher(f"{user_module}:not_a_bool")(RECORDED, RECORDED)
    with pytest.raises(MatcherError, match="raised KeyError"):
        resolve_matcher(f"{user_module}:broken")(RECORDED, RECORDED)
    with pytest.raises(ComponentError, match="has no attribute 'nope'"):
        resolve_matcher(f"{user_module}:nope")


def test_a_plain_callable_is_wrapped_too() -> None:
    with pytest.raises(MatcherError, match="must return a bool"):
        resolve_matcher(lambda a, b: 1)(RECORDED, RECORDED)
    assert resolve_matcher(lambda a, b: True)(RECORDED, RECORDED) is True


def test_a_plugin_distribution_provides_a_matcher_by_name(fake_site) -> None:
    fake_site.module(
        "acme_matchers",
        """
        def role_only(recorded, incoming):
            return recorded.role == incoming.role
        """,
    )
    fake_site.dist(
        "acme-matchers", "1.0", {"miles.session_matchers": {"role_only": "acme_matchers:role_only"}}
    )
    match = resolve_matcher("role_only")
    assert match(RECORDED, msg(content="other text")) is True
