"""Miles' shell agent as a Harbor agent (``-a miles_harbor_agent:MilesShellAgent``).

This module runs inside Harbor's own process and environment (Harbor needs Python 3.12 or newer;
Miles' ``harbor`` agent function puts this directory on its ``PYTHONPATH``), so it imports only
Harbor, ``openai`` and the standard library, never Miles. Its settings come from the
``MILES_HARBOR_AGENT`` environment variable (JSON, written by the Miles side): the episode's
session-server ``base_url``, the prompt messages, the shell tool's spec and the limits.

The loop is the ``terminal`` agent's: the model (through the session server, which decides every
token) gets one tool, ``shell(command)``, run with ``environment.exec`` in the trial's environment;
the episode ends when the model answers without a tool call or at a limit. How it ended goes into
the trial result (``agent_result.metadata``), which the Miles side maps to its exit reasons.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from harbor.agents.base import BaseAgent  # type: ignore[import-not-found]

CONFIG_ENV = "MILES_HARBOR_AGENT"


def format_result(code: int | None, stdout: str, stderr: str, limit: int) -> str:
    """What the model reads back from one command (the ``terminal`` agent's format)."""
    truncated = len(stdout) + len(stderr) > limit
    stdout, stderr = stdout[:limit], stderr[: max(0, limit - len(stdout))]
    head = f"exit code: {code}" if code is not None else "exit code: none (killed)"
    if truncated:
        head += " (output truncated)"
    parts = [head]
    if stdout:
        parts.append(f"stdout:\n{stdout}")
    if stderr:
        parts.append(f"stderr:\n{stderr}")
    return "\n".join(parts)


def shell_command(call: Any, tool: str) -> str | None:
    """The command of a well-formed ``shell`` call, else None."""
    if call.function.name != tool:
        return None
    try:
        arguments = json.loads(call.function.arguments or "")
    except json.JSONDecodeError:
        return None
    command = arguments.get("command") if isinstance(arguments, dict) else None
    return command if isinstance(command, str) and command.strip() else None


class MilesShellAgent(BaseAgent):
    """One shell tool, the policy behind Miles' session server; no retries, no history edits."""

    @staticmethod
    def name() -> str:
        return "miles-shell"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: Any) -> None:
        return None

    async def run(self, instruction: str, environment: Any, context: Any) -> None:
        import openai

        config = json.loads(os.environ[CONFIG_ENV])
        spec = config["tool"]
        tool = spec["function"]["name"]
        # The prompt as Miles' data source built it (its system prompt and template): the task's
        # instruction.md, which is also what Harbor passes as `instruction`.
        messages: list[Any] = list(config["messages"]) or [{"role": "user", "content": instruction}]
        client = openai.AsyncOpenAI(
            base_url=config["base_url"], api_key="unused", max_retries=0, timeout=config["request_timeout_s"]
        )
        stats: dict[str, Any] = {"turns": 0, "tool_calls": 0, "tool_time_s": 0.0, "command_timeouts": 0}
        reason: str | None = "turn_limit"
        failure: str | None = None
        try:
            for _ in range(config["max_turns"]):
                try:
                    reply = await client.chat.completions.create(
                        model=config["model"], messages=messages, tools=[spec], **config["request"]
                    )
                except openai.BadRequestError as err:
                    if "context_length_exceeded" not in str(err):
                        raise
                    reason = "token_limit"
                    break
                except (openai.APIConnectionError, openai.InternalServerError) as err:
                    reason, failure = "environment_error", f"the model server failed: {err}"
                    break
                stats["turns"] += 1
                choice = reply.choices[0]
                message = choice.message
                messages.append(message.model_dump(exclude_none=True))
                if choice.finish_reason == "length":
                    reason = "token_limit"
                    break
                if not message.tool_calls:
                    reason = "completed" if message.content else "no_response"
                    break
                reason = await self._run_calls(environment, message.tool_calls, messages, stats, config, tool)
                if reason is not None:
                    break
                reason = "turn_limit"
        finally:
            await client.close()
            context.metadata = {**stats, "exit_reason": reason, "failure": failure}

    async def _run_calls(
        self,
        environment: Any,
        calls: list[Any],
        messages: list[Any],
        stats: dict[str, Any],
        config: dict[str, Any],
        tool: str,
    ) -> str | None:
        """Run a reply's shell calls; the reason to stop the episode, or None to go on."""
        for call in calls:
            command = shell_command(call, tool)
            if command is None:
                return "format_error"
            stats["tool_calls"] += 1
            t0 = time.perf_counter()
            try:
                done = await environment.exec(command=command, timeout_sec=config["command_timeout_s"])
                text = format_result(
                    done.return_code, done.stdout or "", done.stderr or "", config["output_chars"]
                )
            except RuntimeError as exc:
                # Harbor's container environments raise RuntimeError for a command past its timeout.
                if "timed out" not in str(exc):
                    raise
                stats["command_timeouts"] += 1
                if stats["command_timeouts"] > config["tool_timeout_budget"]:
                    return "tool_error"
                text = f"exit code: none (killed: the command ran past {config['command_timeout_s']} s)"
            finally:
                stats["tool_time_s"] += time.perf_counter() - t0
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return None
