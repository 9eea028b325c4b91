"""The NeMo Gym connector: NeMo Gym datasets and resources servers, played by an agent function.

NeMo Gym splits an environment in three HTTP servers: a *resources server* (the environment:
its tools as ``POST /<tool>`` routes, ``/seed_session`` and ``/verify``, which returns the
reward), a *model server* (a Responses API in front of an OpenAI-compatible model) and an
*agent server* whose ``/run`` plays an episode between the two. Each server runs in a process of
its own, normally in its own virtual environment (``ng_run`` / ``gym env start``).

Here Miles plays the agent, so that every model call goes through the session server and the
trainer sees the engine's tokens; NeMo Gym's resources server stays the environment. One
episode, as NeMo Gym's ``simple_agent`` plays it:

1. ``POST /seed_session`` with the dataset row (the server's session cookie is kept for the
   episode, so a stateful environment sees one session);
2. model calls through the session server with the row's function tools; each tool call the model
   makes is ``POST /<name>`` with its arguments, and the response body is the tool result;
3. ``POST /verify`` with the row and the episode as a Responses API ``response``; its ``reward``
   is the episode's (read it with ``rollout.reward: agent``).

The rows come from the ``nemo_gym`` data source (a NeMo Gym JSONL dataset): the prompt is the
row's ``responses_create_params.input`` as chat messages, ``metadata["nemo_gym"]`` the row.

No NeMo Gym code is imported: the connector speaks its HTTP protocol, so it runs on any Python
Miles runs on, while NeMo Gym (Python 3.12 and newer) runs its servers in its own environment.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from miles.builtins.data.files import read_jsonl, resolve_data_path
from miles.builtins.data.records import PromptFormat, PromptPool, Where, map_records
from miles.capabilities import ComponentOptions, declare_options
from miles.errors import ComponentError, DataError
from miles.types import ExitReason
from miles_envs.interfaces import AgentResult, AgentTask

ROW_KEY = "nemo_gym"
# The resources server's own routes: never reachable as a model's tool call.
_RESERVED_ROUTES = frozenset({"seed_session", "verify", "aggregate_metrics", "mcp"})


# --- the data source --------------------------------------------------------------------------


class NeMoGymDataOptions(ComponentOptions):
    """``data.options`` of the ``nemo_gym`` data source (none yet)."""


class NeMoGymTaskSource(PromptPool):
    """One prompt per row of a NeMo Gym JSONL dataset (rows holding ``responses_create_params``)."""

    Options = NeMoGymDataOptions

    def __init__(
        self,
        path: str,
        *,
        prompt_key: str = "prompt",
        label_key: str | None = "label",
        metadata_keys: Sequence[str] = (),
        shuffle: bool = True,
        seed: int = 0,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        options: dict[str, Any] | None = None,
    ) -> None:
        NeMoGymDataOptions.model_validate(options or {})
        del prompt_key, label_key, metadata_keys  # the row's own layout decides; /verify grades
        fmt = PromptFormat("prompt", None, (ROW_KEY,), apply_chat_template, system_prompt, prompt_template)
        file = resolve_data_path(path)
        super().__init__(
            map_records(_records(read_jsonl(file)), fmt),
            shuffle=shuffle,
            seed=seed,
            name=f"NeMo Gym dataset {str(file)!r}",
        )


def _records(rows: Iterator[tuple[Any, Where]]) -> Iterator[tuple[dict[str, Any], Where]]:
    for row, where in rows:
        if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
            raise DataError(f"{where()}: a NeMo Gym row needs a 'responses_create_params' object")
        params = row["responses_create_params"]
        try:
            messages = input_messages(params)
            chat_tools(params)
        except ValueError as exc:
            raise DataError(f"{where()}: {exc}") from None
        yield {"prompt": messages, ROW_KEY: row}, where


def input_messages(params: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's Responses API ``input`` (and ``instructions``) as chat messages.

    ``developer`` becomes ``system``: chat templates such as Qwen3's render no ``developer``
    message. Earlier turns in the input (``function_call``, ``function_call_output``) become an
    assistant message with tool calls and tool messages.
    """
    messages: list[dict[str, Any]] = []
    if isinstance(params.get("instructions"), str) and params["instructions"]:
        messages.append({"role": "system", "content": params["instructions"]})
    items = params.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError("responses_create_params.input must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}] is not an object")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise ValueError(f"input[{i}] has role {role!r}")
            messages.append({"role": "system" if role == "developer" else role, "content": _text(item, i)})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": str(item["output"])})
        else:
            raise ValueError(f"input[{i}] is a {kind!r} item, which the connector does not take")
    return messages


def _text(item: dict[str, Any], i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("input_text", "output_text") for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"input[{i}] has content other than text, which the connector does not take")


def chat_tools(params: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's Responses API function tools as chat-completion tool specs (as NeMo Gym converts them)."""
    tools = []
    for i, tool in enumerate(params.get("tools") or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ValueError(f"tools[{i}] is a {kind!r} tool; only function tools are played")
        name = tool.get("name")
        if not isinstance(name, str) or not name or name in _RESERVED_ROUTES or "/" in name:
            raise ValueError(f"tools[{i}] has the name {name!r}, which cannot be a resources-server tool")
        function = {k: v for k, v in tool.items() if k not in ("type", "strict")}
        tools.append({"type": "function", "function": function})
    return tools


# --- the agent --------------------------------------------------------------------------------


class NeMoGymOptions(ComponentOptions):
    """``agentic.agent_options`` of the ``nemo_gym`` agent."""

    resources_server: str = Field(
        description="the NeMo Gym resources server's URL, e.g. http://127.0.0.1:8000"
    )
    max_turns: int | None = Field(
        None, gt=0, description="model calls per episode; default: agentic.max_turns"
    )
    model: str = Field("policy", description="the model name sent to the session server")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds one chat completion may take")
    server_timeout_s: float = Field(300.0, gt=0, description="seconds one resources-server call may take")


class _ServerFailed(Exception):
    """The resources server could not be reached or failed (5xx): infrastructure, not the policy."""


@dataclass
class _Episode:
    """What the episode sends to /verify (its Responses API output items) and counts."""

    output: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    bad_tool_calls: int = 0
    tool_time_s: float = 0.0
    incomplete: bool = False

    def add_reply(self, message: Any) -> None:
        reasoning = getattr(message, "reasoning_content", None)
        if reasoning:
            self.output.append(
                {
                    "id": f"rs_{uuid.uuid4().hex}",
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": reasoning}],
                }
            )
        if message.content:
            self.output.append(
                {
                    "id": f"msg_{uuid.uuid4().hex}",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": message.content, "annotations": []}],
                }
            )
        for call in message.tool_calls or []:
            self.output.append(
                {
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.function.name,
                    "arguments": call.function.arguments,
                    "status": "completed",
                }
            )

    def response(self, params: dict[str, Any], model: str) -> dict[str, Any]:
        """The episode as the Responses API ``response`` a NeMo Gym agent hands to /verify."""
        return {
            "id": f"resp_{uuid.uuid4().hex}",
            "created_at": int(time.time()),
            "model": model,
            "object": "response",
            "output": self.output,
            "parallel_tool_calls": params.get("parallel_tool_calls", True),
            "tool_choice": params.get("tool_choice", "auto"),
            "tools": params.get("tools") or [],
            "instructions": params.get("instructions"),
            "metadata": params.get("metadata"),
            "incomplete_details": {"reason": "max_output_tokens"} if self.incomplete else None,
        }


@declare_options(NeMoGymOptions)
async def nemo_gym_agent(task: AgentTask) -> AgentResult:
    """Play one episode of a NeMo Gym resources server with the policy; /verify's reward is the episode's."""
    import httpx
    import openai

    opts = NeMoGymOptions.model_validate(task.options)
    row = task.metadata.get(ROW_KEY)
    if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
        raise ComponentError(
            "the 'nemo_gym' agent needs the NeMo Gym row in metadata['nemo_gym'] (data.source: nemo_gym)"
        )
    params = row["responses_create_params"]
    tools = chat_tools(params)
    names = {t["function"]["name"] for t in tools}
    request: dict[str, Any] = {**task.request, **({"tools": tools} if tools else {})}
    episode = _Episode()
    messages: list[Any] = list(task.messages)
    exit_reason = ExitReason.TURN_LIMIT
    model = openai.AsyncOpenAI(
        base_url=task.base_url, api_key="unused", max_retries=0, timeout=opts.request_timeout_s
    )
    # One client per episode: its cookie jar holds the resources server's session cookie, so the
    # episode's tool calls and /verify reach the session /seed_session opened (as NeMo Gym's agents do).
    server = httpx.AsyncClient(base_url=opts.resources_server.rstrip("/"), timeout=opts.server_timeout_s)
    try:
        await _post(server, "/seed_session", row, "/seed_session")
        for _ in range(opts.max_turns or task.max_turns):
            try:
                reply = await model.chat.completions.create(model=opts.model, messages=messages, **request)
            except openai.BadRequestError as err:
                if "context_length_exceeded" in str(err):
                    exit_reason = ExitReason.TOKEN_LIMIT
                    break
                raise
            except (openai.APIConnectionError, openai.InternalServerError) as err:
                return _failed(episode, ExitReason.ENVIRONMENT_ERROR, f"the model server failed: {err}")
            episode.turns += 1
            choice = reply.choices[0]
            message = choice.message
            episode.add_reply(message)
            messages.append(message.model_dump(exclude_none=True))
            if choice.finish_reason == "length":
                episode.incomplete, exit_reason = True, ExitReason.TOKEN_LIMIT
                break
            if not message.tool_calls:
                exit_reason = ExitReason.COMPLETED if message.content else ExitReason.NO_RESPONSE
                break
            for call in message.tool_calls:
                output = await _call_tool(server, call, names, episode)
                episode.output.append({"type": "function_call_output", "call_id": call.id, "output": output})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        verdict = await _post(
            server, "/verify", {**row, "response": episode.response(params, opts.model)}, "/verify"
        )
    except _ServerFailed as exc:
        return _failed(episode, ExitReason.ENVIRONMENT_ERROR, str(exc))
    finally:
        await server.aclose()
        await model.close()
    reward = verdict.get("reward")
    if not isinstance(reward, int | float) or isinstance(reward, bool):
        raise ComponentError(f"the resources server's /verify returned no numeric reward: {reward!r}")
    return AgentResult(reward=float(reward), metadata=_metadata(episode, verdict), exit_reason=exit_reason)


async def _post(server: Any, path: str, body: Any, what: str) -> Any:
    """POST to the resources server and read its JSON; a failure of the server is ``_ServerFailed``."""
    import httpx

    try:
        response = await server.post(path, json=body)
    except httpx.HTTPError as exc:
        raise _ServerFailed(f"the resources server's {what} failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code >= 500:
        raise _ServerFailed(
            f"the resources server's {what} answered {response.status_code}: {response.text[:500]}"
        )
    if response.status_code >= 400:
        # The row does not fit what the server takes: a data or configuration mistake, not infrastructure.
        raise ComponentError(
            f"the resources server refused {what} ({response.status_code}): {response.text[:500]}"
        )
    try:
        return response.json()
    except ValueError:
        raise ComponentError(
            f"the resources server's {what} did not answer JSON: {response.text[:200]!r}"
        ) from None


async def _call_tool(server: Any, call: Any, names: set[str], episode: _Episode) -> str:
    """Run one tool call on the resources server; what the model reads back."""
    import httpx

    name = call.function.name
    if name not in names:
        episode.bad_tool_calls += 1
        return json.dumps({"error": f"unknown tool {name!r}; the tools are {sorted(names)}"})
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        # As NeMo Gym's simple agent does: the model reads the error and the episode goes on.
        episode.bad_tool_calls += 1
        return json.dumps({"error": f"Invalid tool call arguments: {exc!r}"})
    episode.tool_calls += 1
    t0 = time.perf_counter()
    try:
        response = await server.post(f"/{name}", json=arguments)
    except httpx.HTTPError as exc:
        raise _ServerFailed(f"the resources server's /{name} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        episode.tool_time_s += time.perf_counter() - t0
    # Any status is the tool's answer: NeMo Gym servers report a bad call (422, 4xx) or a tool's own
    # exception (500 with its repr) to the model, and its agents pass the body on unchanged.
    return response.text


def _metadata(episode: _Episode, verdict: dict[str, Any] | None = None) -> dict[str, Any]:
    extra = {
        k: v
        for k, v in (verdict or {}).items()
        if k not in ("reward", "response", "responses_create_params")
        and isinstance(v, str | int | float | bool)
    }
    metadata: dict[str, Any] = {
        "turns": episode.turns,
        "tool_calls": episode.tool_calls,
        "bad_tool_calls": episode.bad_tool_calls,
        "tool_time_s": episode.tool_time_s,
    }
    if verdict is not None:
        metadata["nemo_gym_verify"] = extra
    return metadata


def _failed(episode: _Episode, reason: ExitReason, failure: str) -> AgentResult:
    return AgentResult(reward=None, metadata=_metadata(episode), failure=failure, exit_reason=reason)
