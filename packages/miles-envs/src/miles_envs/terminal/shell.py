"""The shell tool a terminal-task agent gets: one function, ``shell(command)``, run in the episode's sandbox."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from miles_envs.sandbox.base import ExecReason, ExecResult

SHELL_TOOL = "shell"

#: The OpenAI tool spec the model sees.
SHELL_SPEC: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": SHELL_TOOL,
        "description": (
            "Run a shell command (sh -c) in the task's working directory and return its exit code and "
            "output. Files persist between calls; nothing else does (no background processes, no network)."
        ),
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command line to run"}},
            "required": ["command"],
        },
    },
}


class FormatError(ValueError):
    """A tool call the agent cannot run: an unknown tool, or arguments that are not ``{"command": str}``."""


@dataclass(frozen=True)
class ShellCall:
    call_id: str
    command: str


def parse_call(call: dict[str, Any]) -> ShellCall:
    """An OpenAI tool call (``{"id", "function": {"name", "arguments"}}``) as a shell command."""
    function = call.get("function") or {}
    name = function.get("name")
    if name != SHELL_TOOL:
        raise FormatError(f"unknown tool {name!r}; the only tool is {SHELL_TOOL!r}")
    raw = function.get("arguments")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as err:
        raise FormatError(f"tool arguments are not JSON: {err}") from None
    if not isinstance(arguments, dict) or not isinstance(arguments.get("command"), str):
        raise FormatError('tool arguments must be {"command": "<string>"}')
    command = arguments["command"]
    if not command.strip():
        raise FormatError("the command is empty")
    return ShellCall(call_id=str(call.get("id") or ""), command=command)


def format_result(result: ExecResult) -> str:
    """What the model reads back from one command."""
    head = f"exit code: {result.exit_code}" if result.exit_code is not None else "exit code: none (killed)"
    if result.reason is not ExecReason.OK:
        head += f" ({result.reason.value}{', output truncated' if result.truncated else ''})"
    parts = [head]
    if result.stdout:
        parts.append(f"stdout:\n{result.stdout}")
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr}")
    return "\n".join(parts)
