"""The built-in agent function: a tool-calling loop written with the ``openai`` SDK.

It is what a user's agent looks like: it knows only the base URL it was given and speaks
OpenAI chat completions. It sends the prompt with the run's tools, runs every tool call the
model makes with the task's tool set, sends the results back, and stops when the model
answers without a tool call, after ``task.max_turns`` model calls, or when the server says
the conversation is out of tokens (HTTP 400 ``context_length_exceeded``; the server has
recorded the trajectory as truncated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from pydantic import Field

from miles.capabilities import ComponentOptions, declare_options
from miles.errors import ComponentError
from miles_envs.interfaces import AgentResult, AgentTask
from miles_envs.tools.calculator import run_tool_calls

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam


class ToolAgentOptions(ComponentOptions):
    timeout_s: float = Field(600.0, description="seconds one chat completion may take")
    model: str = Field("policy", description="the model name sent to the session server")


@declare_options(ToolAgentOptions)  # agentic.agent_options, read from AgentTask.options
async def tool_agent(task: AgentTask) -> AgentResult:
    try:
        import openai
    except ImportError:
        raise ComponentError(
            "the built-in agent 'tool_agent' needs the openai package: pip install openai (a dependency of miles-envs)"
        ) from None
    client = openai.AsyncOpenAI(
        base_url=task.base_url,
        api_key="unused",  # the session server needs no key (it binds to 127.0.0.1)
        max_retries=0,  # a retried turn would be a second sample of the same turn
        timeout=float(task.options.get("timeout_s", 600.0)),
    )
    messages: list[dict[str, Any]] = [dict(m) for m in task.messages]
    extra: dict[str, Any] = {"tools": task.tools} if task.tools else {}
    calls = turns = 0
    ended_by = "max_turns"
    try:
        while turns < task.max_turns:
            try:
                reply = await client.chat.completions.create(
                    model=task.options.get("model", "policy"),
                    # OpenAI chat messages as plain dicts (the session server validates them).
                    messages=cast("list[ChatCompletionMessageParam]", messages),
                    **task.request,
                    **extra,
                )
            except openai.BadRequestError as exc:
                if _code(exc) != "context_length_exceeded":
                    raise
                ended_by = "context_length_exceeded"
                break
            turns += 1
            choice = reply.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            tool_calls = [c.model_dump() for c in choice.message.tool_calls or []]
            if choice.finish_reason != "tool_calls" or not tool_calls or task.toolset is None:
                ended_by = choice.finish_reason
                break
            calls += len(tool_calls)
            messages += await run_tool_calls(task.toolset, tool_calls)
    finally:
        await client.close()
    return AgentResult(metadata={"agent_turns": turns, "agent_tool_calls": calls, "agent_ended_by": ended_by})


def _code(exc: Any) -> str | None:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return error.get("type") or error.get("code")
    return None
