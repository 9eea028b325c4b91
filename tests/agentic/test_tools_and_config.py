"""The calculator tool set, running a reply's tool calls, and the `agentic:` recipe rules."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.config import load_recipe
from miles.errors import ConfigError, ToolError
from miles.plugins import build_plugin_manager, make_component
from miles_envs.tools.calculator import Calculator, evaluate_arithmetic, run_tool_calls

TINY = str(Path(__file__).parents[1] / "data" / "recipes" / "tiny.yaml")


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2+3", 5),
        ("12*(3+4)", 84),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-3**2", -9),
        ("2**10 % 7", 2),
        (" 1.5*2 ", 3.0),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", "only numbers"),
        ("(1).__class__", "only numbers"),
        ("x + 1", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("1/0", "division by zero"),
        ("9**9999", "exponent"),
        ("10**20 * 10**20", "out of range"),
        ("1 +", "cannot parse"),
        ("", "non-empty"),
        ("1+" * 200 + "1", "longer than"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression: str, error: str) -> None:
    with pytest.raises(ToolError, match=error):
        evaluate_arithmetic(expression)


def test_tool_calls_become_tool_messages_and_model_errors_stay_in_the_episode() -> None:
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "search", "arguments": "{}"}},
        {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{not json"}},
        {"id": "d", "type": "function", "function": {"name": "calculator", "arguments": '{"expr": "1"}'}},
    ]
    messages = asyncio.run(run_tool_calls(Calculator(), calls))
    assert [m["tool_call_id"] for m in messages] == ["a", "b", "c", "d"]
    assert all(m["role"] == "tool" for m in messages)
    assert messages[0]["content"] == "42"
    assert messages[1]["content"].startswith("error: unknown tool 'search'")
    assert messages[2]["content"].startswith("error: ")
    assert messages[3]["content"].startswith("error: calculator takes one argument")


def test_a_broken_tool_set_fails_loudly() -> None:
    class Broken:
        def specs(self) -> list:
            return []

        async def call(self, name: str, arguments: dict) -> str:
            raise RuntimeError("tool backend down")

    call = {"id": "a", "function": {"name": "x", "arguments": "{}"}}
    with pytest.raises(RuntimeError, match="tool backend down"):
        asyncio.run(run_tool_calls(Broken(), [call]))


def test_tool_sets_and_agents_are_selected_by_name() -> None:
    assert isinstance(make_component("toolset", "calculator"), Calculator)
    from miles.plugins import load_component
    from miles_envs.agents import tool_agent

    assert load_component("agent", "tool_agent") is tool_agent


# ------------------------------------------------------------------------------------ recipe rules


@pytest.fixture(scope="module")
def pm():
    return build_plugin_manager(strict=False, disabled=["broken"])


def _problem(overrides: list[str], pm) -> str:
    """The refusal of the recipe or of its components' needs (checked before a run starts anything)."""
    from miles.capabilities import check_needs

    with pytest.raises(ConfigError) as info:
        check_needs(load_recipe(TINY, overrides, pm=pm))
    return str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.generate_fn=agentic"], "needs an `agentic:` section"),
        (["rollout.generate_fn=multi_turn"], "needs an `agentic:` section"),
        (["agentic={family: qwen3}"], "rollout.generate_fn 'default' does not use it"),
        (["rollout.generate_fn=agentic", "agentic={}"], "agentic.family"),
        (
            [
                "rollout.generate_fn=agentic",
                "agentic={family: qwen3}",
                "schedule=fully_async",
                "fully_async.update_mode=abort",
            ],
            "fully_async.update_mode 'abort' cannot be used with sessions",
        ),
        (
            [
                "rollout.generate_fn=multi_turn",
                "agentic={family: qwen3}",
                "schedule=fully_async",
                "fully_async.update_mode=abort",
            ],
            "fully_async.update_mode 'abort' cannot be used with sessions",
        ),
        (
            ["rollout.generate_fn=multi_turn", "agentic={family: qwen3, session_mode: branching}"],
            "drives a linear conversation itself",
        ),
        (["rollout.generate_fn=agentic", "agentic={family: qwen3, max_turns: 0}"], "max_turns"),
        (
            [
                "rollout.generate_fn=agentic",
                "agentic={family: qwen3}",
                "eval={data: {path: x.jsonl}, mode: dedicated}",
            ],
            "eval.mode 'dedicated' with rollout.generate_fn 'agentic' is not supported",
        ),
    ],
)
def test_agentic_recipe_refusals(overrides: list[str], message: str, pm) -> None:
    assert message in _problem(overrides, pm)


def test_sessions_survive_retract_and_in_place_updates(pm) -> None:
    for mode in ("retract", "in_place"):
        config = load_recipe(
            TINY,
            [
                "rollout.generate_fn=agentic",
                "agentic={family: qwen3, tools: calculator}",
                "schedule=fully_async",
                f"fully_async.update_mode={mode}",
            ],
            pm=pm,
        )
        assert config.agentic.family == "qwen3" and config.agentic.tools == "calculator"
        assert config.agentic.server_host == "127.0.0.1"


def test_unknown_tool_set_agent_or_matcher_fails_before_anything_starts(pm) -> None:
    from miles.errors import ComponentError
    from miles_envs.service import resolve_agentic

    base = ["rollout.generate_fn=agentic"]
    for section, message in [
        ("agentic={family: qwen3, tools: calculater}", "calculator"),
        ("agentic={family: qwen3, agent: tool_agnt}", "tool_agent"),
        ("agentic={family: qwen3, matcher: strikt}", "strict"),
    ]:
        config = load_recipe(TINY, [*base, section], pm=pm)
        with pytest.raises((ComponentError, ConfigError), match=message):
            resolve_agentic(config)
