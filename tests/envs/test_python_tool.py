"""The ``python_sandbox`` tool set: model-written Python runs in a fresh sandbox per call; with
reasoning-gym tasks, its output is scored by the task's own verifier."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from miles.errors import ToolError
from miles.plugins import make_component
from miles.types import Prompt, Sample
from miles_envs.sandbox.local import LocalProvider
from miles_envs.tools.calculator import run_tool_calls
from miles_envs.tools.python_exec import PythonSandbox

LIMITS = {"wall_s": 5.0, "cpu_s": 5, "memory_bytes": 512 << 20}


@pytest.fixture
def tool(provider: LocalProvider) -> PythonSandbox:
    made = make_component("toolset", "python_sandbox", {"timeout_s": 3.0, "limits": LIMITS})
    assert isinstance(made, PythonSandbox)
    made._provider = provider  # the session's probed provider (same class the option names)
    return made


def test_runs_code_and_reports_output_and_errors(tool: PythonSandbox) -> None:
    assert asyncio.run(tool.call("python", {"code": "print(6 * 7)"})) == "exit code: 0\nstdout:\n42\n"
    out = asyncio.run(tool.call("python", {"code": "raise SystemExit('boom')"}))
    assert out.startswith("exit code: 1") and "boom" in out
    out = asyncio.run(tool.call("python", {"code": "while True: pass"}))
    assert "timeout" in out


def test_calls_share_nothing_and_cannot_reach_the_network(tool: PythonSandbox) -> None:
    asyncio.run(tool.call("python", {"code": "open('state.txt', 'w').write('x')"}))
    out = asyncio.run(tool.call("python", {"code": "import os; print(os.path.exists('state.txt'))"}))
    assert "False" in out
    code = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('open')\nexcept OSError:\n    print('blocked')"
    assert "blocked" in asyncio.run(tool.call("python", {"code": code}))


def test_bad_calls_are_tool_errors(tool: PythonSandbox) -> None:
    with pytest.raises(ToolError, match="unknown tool"):
        asyncio.run(tool.call("shell", {"code": "1"}))
    with pytest.raises(ToolError, match="code"):
        asyncio.run(tool.call("python", {"source": "1"}))


def test_reasoning_gym_task_solved_with_the_tool_and_scored_by_its_verifier(tool: PythonSandbox) -> None:
    pytest.importorskip("reasoning_gym")
    source = make_component(
        "data_source", "reasoning_gym", {"path": "basic_arithmetic", "options": {"size": 3}}
    )
    reward = make_component("reward", "reasoning_gym")
    for prompt in source.next_prompts(3):
        question = prompt.metadata["reasoning_gym"]["entry"]["question"]
        expression = re.findall(r"[-+*/().\d ]{3,}", question)[0].strip().rstrip("=").strip()
        call = {
            "id": "c0",
            "function": {"name": "python", "arguments": json.dumps({"code": f"print({expression})"})},
        }
        (message,) = asyncio.run(run_tool_calls(tool, [call]))
        value = message["content"].split("stdout:\n")[1].strip()
        answer = str(int(float(value))) if float(value).is_integer() else value
        right = Sample(
            prompt=Prompt(index=0, prompt="", metadata=prompt.metadata),
            response_text=f"<answer>{answer}</answer>",
        )
        wrong = Sample(
            prompt=Prompt(index=0, prompt="", metadata=prompt.metadata), response_text="<answer>-0.5</answer>"
        )
        assert reward(right) == 1.0, (question, expression, value)
        assert reward(wrong) == 0.0
