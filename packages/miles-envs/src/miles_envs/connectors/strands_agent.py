"""The Strands Agents connector: an agent function that runs a Strands ``Agent`` against the session server.

One episode: a Strands ``Agent`` is built whose model is Strands' OpenAI model provider pointed at
the episode's ``base_url`` (the session server, which decides the tokens), with the recipe's
request settings (temperature, top_p, max_tokens) as its parameters. Its tools are the run's tool
set (``agentic.tools``: each spec becomes a Strands tool that calls ``task.toolset.call``) and the
Strands tools named in ``agent_options.tools`` (import paths of ``@strands.tool`` functions or
other ``AgentTool`` objects). The prompt's messages are the conversation; Strands' own loop calls
the model and the tools until the model answers without a tool call or ``max_turns`` model calls
are spent.

What the connector sets so that the session stays one trajectory: no retries (a retried turn
would be a second sample), no conversation manager (Strands would otherwise trim the history it
resends), no streaming (the session server answers whole replies), and text content sent as a
string (Strands sends content parts, which chat templates such as Qwen3's render as nothing).

Strands' OpenAI provider does not send a reply's reasoning back: with a thinking model the
resent history differs from the recorded one (see docs/sessions.md, replay matchers).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import Field

from miles.capabilities import ComponentOptions, declare_options
from miles.errors import ComponentError, ConfigError, ToolError
from miles.types import ExitReason
from miles_envs.interfaces import AgentResult, AgentTask, ToolSet

if TYPE_CHECKING:
    from strands import Agent
    from strands.models.openai import OpenAIModel
    from strands.tools.tools import PythonAgentTool
    from strands.types.content import Message as StrandsMessage
    from strands.types.tools import AgentTool, ToolResult, ToolSpec, ToolUse

# The stop reasons of a Strands invocation (strands.types.event_loop.StopReason) this connector
# maps; any other one ends the episode as completed and is kept in metadata["strands_stop_reason"].
_STOP_REASONS = {
    "end_turn": ExitReason.COMPLETED,
    "stop_sequence": ExitReason.COMPLETED,
    "limit_turns": ExitReason.TURN_LIMIT,
    "max_tokens": ExitReason.TOKEN_LIMIT,
}


class StrandsOptions(ComponentOptions):
    """``agentic.agent_options`` of the ``strands`` agent."""

    system_prompt: str | None = Field(
        None, description="the Agent's system prompt when the prompt has no system message"
    )
    tools: list[str] = Field(
        default_factory=list,
        description="pkg.module:attr import paths of Strands tools (@strands.tool functions, AgentTool objects)",
    )
    max_turns: int | None = Field(
        None, gt=0, description="model calls per episode; default: agentic.max_turns"
    )
    model: str = Field("policy", description="the model name sent to the session server")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds one chat completion may take")


def _require_strands() -> None:
    try:
        importlib.import_module("strands")
    except ImportError:
        raise ComponentError(
            "the 'strands' agent needs strands-agents: pip install 'miles-envs[strands]'"
        ) from None


def load_tools(specs: list[str]) -> list[AgentTool]:
    """The Strands tools named by ``agent_options.tools`` (each an ``AgentTool``, e.g. a ``@tool`` function)."""
    from strands.types.tools import AgentTool

    tools = []
    for spec in specs:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(f"agentic.agent_options.tools: {spec!r} must be an import path pkg.module:attr")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"agentic.agent_options.tools: {spec!r} cannot be imported: {err}") from err
        if not isinstance(obj, AgentTool):
            raise ConfigError(
                f"agentic.agent_options.tools: {spec!r} is a {type(obj).__name__}, not a Strands tool "
                "(decorate the function with @strands.tool)"
            )
        tools.append(obj)
    return tools


@functools.cache
def _session_model_class() -> type[OpenAIModel]:
    """Strands' OpenAI provider, sending all-text content as a string."""
    from strands.models.openai import OpenAIModel

    class SessionOpenAIModel(OpenAIModel):
        @classmethod
        def format_request_messages(cls, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
            return [_text_as_string(m) for m in super().format_request_messages(*args, **kwargs)]

    return SessionOpenAIModel


def _text_as_string(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list) and all(part.get("type") == "text" for part in content):
        return {**message, "content": "".join(part["text"] for part in content)}
    return message


def strands_messages(messages: list[dict[str, Any]]) -> tuple[list[StrandsMessage], str | None]:
    """The prompt's chat messages as Strands messages, and its system text (None: it has none).

    A prompt is text: system (or developer) messages first, then user and assistant messages. A
    prompt that already holds tool calls or tool results is refused.
    """
    system: list[str] = []
    out: list[StrandsMessage] = []
    for i, message in enumerate(messages):
        role, text = message.get("role"), _text(message.get("content"), i)
        if message.get("tool_calls") or role == "tool":
            raise ComponentError(
                f"the 'strands' agent takes text prompts; message {i} is a tool call or result"
            )
        if role in ("system", "developer"):
            if out:
                raise ComponentError(f"the 'strands' agent takes system messages first; message {i} is not")
            system.append(text)
        elif role in ("user", "assistant"):
            out.append({"role": role, "content": [{"text": text}]})
        else:
            raise ComponentError(f"the 'strands' agent cannot take message {i} with role {role!r}")
    return out, "\n\n".join(system) if system else None


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    if content is None:
        return ""
    raise ComponentError(f"the 'strands' agent takes text prompts; message {index} has other content")


@dataclass
class _Episode:
    """What one episode counts (model calls, tool calls, time in tools) and a tool set that broke."""

    agent: Agent | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_time_s: float = 0.0
    broken: list[BaseException] = field(default_factory=list)

    def toolset_tools(self, toolset: ToolSet, specs: list[dict[str, Any]]) -> list[PythonAgentTool]:
        """A Strands tool per OpenAI spec of the run's tool set, each running ``toolset.call``."""
        from strands.tools.tools import PythonAgentTool

        tools = []
        for spec in specs:
            function = spec["function"]
            name = function["name"]
            schema = function.get("parameters") or {"type": "object", "properties": {}}
            strands_spec: ToolSpec = {
                "name": name,
                "description": function.get("description") or "",
                "inputSchema": {"json": schema},
            }
            tools.append(PythonAgentTool(name, strands_spec, self._runner(toolset, name)))
        return tools

    def _runner(self, toolset: ToolSet, name: str) -> Any:
        async def run(tool_use: ToolUse, **_: Any) -> ToolResult:
            arguments = tool_use["input"]
            try:
                if not isinstance(arguments, dict):
                    raise ToolError(f"the arguments of {name} must be a JSON object")
                text = await toolset.call(name, arguments)
            except ToolError as exc:
                return _tool_result(tool_use, f"error: {exc}", ok=False)
            except Exception as exc:
                # A broken tool set fails the trajectory (the ToolSet contract); Strands would hand
                # the error to the model, so the episode is stopped and the error raised afterwards.
                self.broken.append(exc)
                if self.agent is not None:
                    self.agent.cancel()
                return _tool_result(tool_use, f"error: {exc}", ok=False)
            return _tool_result(tool_use, str(text), ok=True)

        return run

    def before_model_call(self, event: Any) -> None:
        self.turns += 1

    def after_tool_call(self, event: Any) -> None:
        self.tool_calls += 1
        self.tool_time_s += event.duration or 0.0


def _tool_result(tool_use: ToolUse, text: str, *, ok: bool) -> ToolResult:
    return {
        "toolUseId": tool_use["toolUseId"],
        "status": "success" if ok else "error",
        "content": [{"text": text}],
    }


@declare_options(StrandsOptions)
async def strands_agent(task: AgentTask) -> AgentResult:
    """Run one episode with a Strands ``Agent`` whose model is the session server."""
    _require_strands()
    import openai
    from strands import Agent
    from strands.agent.conversation_manager import NullConversationManager
    from strands.hooks import AfterToolCallEvent, BeforeModelCallEvent
    from strands.types.exceptions import ContextWindowOverflowException, MaxTokensReachedException

    opts = StrandsOptions.model_validate(task.options)
    user_tools = load_tools(opts.tools)
    messages, system = strands_messages(task.messages)
    episode = _Episode()
    tools: list[Any] = list(user_tools)
    if task.toolset is not None:
        tools += episode.toolset_tools(task.toolset, task.tools or task.toolset.specs())
    names = [t.tool_name for t in tools]
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"agentic.agent_options.tools: tool names {clash} are also the run's tool set's")
    model = _session_model_class()(
        client_args={
            "base_url": task.base_url,
            "api_key": "unused",  # the session server needs no key (it binds to 127.0.0.1)
            "max_retries": 0,  # a retried turn would be a second sample of the same turn
            "timeout": opts.request_timeout_s,
        },
        model_id=opts.model,
        params=dict(task.request),
        stream=False,
    )
    agent = Agent(
        model=model,
        tools=tools,
        system_prompt=system if system is not None else opts.system_prompt,
        callback_handler=None,
        conversation_manager=NullConversationManager(),
        retry_strategy=None,
    )
    episode.agent = agent
    agent.add_hook(episode.before_model_call, BeforeModelCallEvent)
    agent.add_hook(episode.after_tool_call, AfterToolCallEvent)
    failure: str | None = None
    stop_reason: str | None = None
    try:
        result = await agent.invoke_async(messages, limits={"turns": opts.max_turns or task.max_turns})
        stop_reason = str(result.stop_reason)
        exit_reason = _STOP_REASONS.get(stop_reason, ExitReason.COMPLETED)
        if exit_reason is ExitReason.COMPLETED and not _has_text(result.message):
            exit_reason = ExitReason.NO_RESPONSE
    except (MaxTokensReachedException, ContextWindowOverflowException):
        exit_reason = ExitReason.TOKEN_LIMIT
    except Exception as exc:
        cause = _model_server_failure(exc, openai)
        if cause is None:
            raise
        exit_reason, failure = ExitReason.ENVIRONMENT_ERROR, f"the model server failed: {cause}"
    if episode.broken:
        raise episode.broken[0]
    metadata = {
        "turns": episode.turns,
        "tool_calls": episode.tool_calls,
        "tool_time_s": episode.tool_time_s,
        "strands_stop_reason": stop_reason,
    }
    return AgentResult(metadata=metadata, failure=failure, exit_reason=exit_reason)


def _has_text(message: StrandsMessage) -> bool:
    return any(block.get("text") or block.get("toolUse") for block in message.get("content", []))


def _model_server_failure(exc: BaseException, openai: Any) -> BaseException | None:
    """The unreachable or failing (5xx) model server behind ``exc`` (Strands may wrap it), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, openai.APIConnectionError | openai.InternalServerError):
            return seen
        seen = getattr(seen, "original_exception", None) or seen.__cause__
    return None
