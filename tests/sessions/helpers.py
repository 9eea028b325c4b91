"""Drive a session the way the HTTP layer does: plan, "render" and "generate" tokens, commit.

The token ids are synthetic but unique (a counter), so a test can tell exactly which turn
produced which token; the store never interprets them.
"""

from __future__ import annotations

import itertools
from typing import Any

from miles_envs.sessions import Checkpoint, Plan, Session

SYSTEM = {"role": "system", "content": "You are a helpful agent."}
USER = {"role": "user", "content": "What is the weather in Paris?"}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant(
    content: str = "", calls: list[dict[str, Any]] | None = None, reasoning: str | None = None
) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


class Engine:
    """Hands out fresh token ids; ``run`` plays one turn against a session."""

    def __init__(self) -> None:
        self._ids = itertools.count(1000)

    def ids(self, n: int) -> list[int]:
        return [next(self._ids) for _ in range(n)]

    def commit(
        self,
        session: Session,
        plan: Plan,
        reply: dict[str, Any],
        *,
        n_out: int = 3,
        finish: str = "stop",
        versions: list[int] | None = None,
        experts: bool = False,
        suffix_experts: bool = False,
    ) -> Checkpoint:
        suffix = self.ids(
            2 * len(plan.new_messages) + 1
        )  # a couple of tokens per message + the generation prompt
        out = self.ids(n_out)
        return session.commit(
            plan,
            prompt_suffix_ids=suffix,
            output_ids=out,
            output_logprobs=[-0.01 * (t % 50 + 1) for t in out],
            weight_versions=versions if versions is not None else [0] * n_out,
            finish_reason=finish,
            assistant_message=reply,
            weight_version=0,
            routed_experts=[expert_row(t) for t in out] if experts else None,
            suffix_routed_experts=[expert_row(t) for t in suffix] if suffix_experts else None,
        )

    def run(
        self, session: Session, messages: list[dict[str, Any]], reply: dict[str, Any], **kw: Any
    ) -> Checkpoint:
        return self.commit(session, session.plan(messages), reply, **kw)


def expert_row(token: int, layers: int = 2, topk: int = 2) -> list[list[int]]:
    """A recognisable routing for a token: layer l, slot k -> token * 10 + l + k (fits no real model)."""
    return [[(token % 97) * 4 + layer * 2 + k for k in range(topk)] for layer in range(layers)]


def weather_episode() -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Three turns: call a tool, call another, answer. Each item: (request messages, reply)."""
    r1 = assistant(
        "", [tool_call("call_1", "get_weather", '{"city": "Paris", "unit": "C"}')], reasoning="look it up"
    )
    r2 = assistant("", [tool_call("call_2", "get_time", '{"tz": "Europe/Paris"}')], reasoning="and the time")
    r3 = assistant("It is 21 C at 14:00 in Paris.", reasoning="done")
    m1 = [SYSTEM, USER]
    m2 = [*m1, r1, tool("call_1", '{"temp": 21}')]
    m3 = [*m2, r2, tool("call_2", "14:00")]
    return [(m1, r1), (m2, r2), (m3, r3)]


def play(engine: Engine, session: Session, turns: int = 3, **kw: Any) -> list[Checkpoint]:
    return [engine.run(session, msgs, reply, **kw) for msgs, reply in weather_episode()[:turns]]
