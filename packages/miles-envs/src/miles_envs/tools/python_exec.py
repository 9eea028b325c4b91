"""``python_sandbox``: a tool set whose one tool runs model-written Python in a fresh sandbox.

``agentic.tools: python_sandbox`` gives the model ``python(code)``: the code is written to
``main.py`` in a new sandbox (``local-dir`` by default) and run with ``python3``; the tool message
is the exit code, stdout and stderr. Every call gets its own sandbox (nothing carries over
between calls, so episodes running concurrently cannot see each other), closed when the call ends.
A call the sandbox infrastructure cannot serve raises (the trajectory fails, it is not scored
as the model's mistake); bad arguments are a ``ToolError`` the model reads.

Options (``agentic.tools_options``): ``provider``, ``provider_options``, ``timeout_s`` per call,
``limits`` (SandboxLimits fields).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.errors import ToolError
from miles_envs.sandbox.base import SandboxLimits, SandboxProvider, SandboxSpec
from miles_envs.sandbox.registry import make_provider
from miles_envs.terminal.shell import format_result


class PythonSandboxOptions(ComponentOptions):
    provider: str = Field("local-dir", description="sandbox provider name or import path")
    provider_options: dict[str, Any] = Field(default_factory=dict, description="the provider's options")
    timeout_s: float = Field(10.0, gt=0, description="wall clock of one call")
    limits: dict[str, Any] = Field(default_factory=dict, description="SandboxLimits fields")


class PythonSandbox:
    """The ``python_sandbox`` tool set."""

    Options = PythonSandboxOptions

    SPEC: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "python",
            "description": (
                "Run a Python 3 program and return its exit code, stdout and stderr. Each call starts "
                "fresh: no files or variables persist, and there is no network. Print what you need."
            ),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program's source"}},
                "required": ["code"],
            },
        },
    }

    def __init__(
        self,
        provider: str = "local-dir",
        provider_options: dict[str, Any] | None = None,
        timeout_s: float = 10.0,
        limits: dict[str, Any] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.limits = SandboxLimits(**(limits or {}))
        self._provider_ref = (provider, dict(provider_options or {}))
        self._provider: SandboxProvider | None = None

    def specs(self) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(self.SPEC))]

    def provider(self) -> SandboxProvider:
        if self._provider is None:  # built on first use: the tool set is made in the driver
            self._provider = make_provider(*self._provider_ref)
        return self._provider

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "python":
            raise ToolError(f"unknown tool {name!r}; available: python")
        code = arguments.get("code")
        if sorted(arguments) != ["code"] or not isinstance(code, str):
            raise ToolError(f"python takes one string argument, code (got {sorted(arguments)})")
        sandbox = await self.provider().create(SandboxSpec(files={"main.py": code}, limits=self.limits))
        try:
            result = await sandbox.exec("python3 main.py", timeout_s=self.timeout_s)
        finally:
            await sandbox.close()
        return format_result(result)
