"""Session server cost per turn, turn 1 to 50, against re-tokenizing the whole history each turn.

    uv run python benchmarks/session_turn_cost.py [--family qwen3] [--turns 50] [--repeats 5]
                                                  [--mode linear|branching]

A growing tool-calling conversation (user -> assistant tool call -> tool result -> ...),
measured three ways per turn, each in a pass of its own (interleaved, the big baseline renders
slow down the next turn's work, whatever comes next):

* store path: what the server does besides HTTP and generating. It plans the request against
  the session (recognise or parse + match the resent history), renders only the new messages
  (``suffix_ids``), parses the reply and commits the checkpoint.
* HTTP handler: the session server's whole chat-completions route, called in process through
  ASGI with the request body as bytes: JSON decoding, body and message validation, the store
  path, the response. The engine is a stand-in that answers at once; the agent (building the
  body, reading the response) is not timed.
* baseline: render and tokenize each turn's whole request (what a server without checkpoints must do).

The "reply" is the family's own rendering of a fixed tool-calling assistant message, so every
path sees the same tokens. Times are CPU seconds of the thread doing the work (``--clock cpu``,
the default: on a shared machine, wall time also counts other processes' time slices) or wall
seconds (``--clock wall``). Each turn is summarised by the fastest of the runs (other work on
the machine only ever adds time; the medians are in the JSON too). Growth is reported two
ways: turns 48-50 over turns 2-4 (turn 1 renders the whole first prompt), and the same ratio
read off a least-squares line through turns 2-50, which one noisy turn cannot move much.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import time
from typing import Any

from miles.types import GenerateOutput, SamplingParams
from miles_envs.families import get_family
from miles_envs.families.artefacts import family_tokenizer
from miles_envs.session_server.app import ServerState, create_app
from miles_envs.sessions import SessionStore

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
FIRST = [
    {"role": "system", "content": "You are a research agent."},
    {"role": "user", "content": "Find X."},
]


def reply(turn: int) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{turn}",
                "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"q": f"query {turn}"})},
            }
        ],
    }


def tool_result(turn: int) -> dict:
    return {
        "role": "tool",
        "tool_call_id": f"call_{turn}",
        "content": f"result {turn}: " + "lorem ipsum " * 20,
    }


clock = time.thread_time


def store_run(family, tok, turns: int, mode: str) -> tuple[list[float], list[dict]]:
    """Per turn: seconds of the store path; and the conversation (every request's messages)."""
    session = SessionStore(mode=mode).create()
    messages: list[dict] = [dict(m) for m in FIRST]
    seconds = []
    for turn in range(turns):
        output = output_ids(family, tok, turn)  # the engine's stand-in (cached: not timed)
        t0 = clock()
        plan = session.plan(messages)
        if plan.parent is None:
            suffix = family.render_ids(tok, messages, TOOLS)
        else:
            prefix = plan.prefix_ids
            suffix = family.suffix_ids(
                tok,
                [m.to_openai() for m in plan.new_messages],
                TOOLS,
                previous=plan.parent.assistant.to_openai(),
                stop_id=prefix[-1],
            )
        parsed = family.parse_reply(tok, output, tools=TOOLS)
        session.commit(
            plan,
            prompt_suffix_ids=suffix,
            output_ids=output,
            output_logprobs=[0.0] * len(output),
            weight_versions=[0] * len(output),
            finish_reason="tool_calls",
            assistant_message=parsed.to_message(),
        )
        seconds.append(clock() - t0)
        messages += [parsed.to_message(), tool_result(turn)]
    return seconds, messages


def retokenize_run(family, tok, conversation: list[dict], turns: int) -> list[float]:
    """Per turn: seconds to render and tokenize that turn's whole request."""
    seconds = []
    for turn in range(turns):
        request = conversation[: len(FIRST) + 2 * turn]
        t0 = clock()
        family.render_ids(tok, request, TOOLS)
        seconds.append(clock() - t0)
    return seconds


class StandInEngine:
    """Answers every ``generate`` at once with the reply of the turn (the n-th call of a conversation)."""

    def __init__(self, family, tok) -> None:
        self.family, self.tok, self.calls = family, tok, 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerateOutput:
        ids = output_ids(self.family, self.tok, self.calls)
        self.calls += 1
        return GenerateOutput(
            output_ids=list(ids), output_logprobs=[0.0] * len(ids), finish_reason="stop", weight_version=0
        )


def http_run(family, tok, turns: int, mode: str) -> list[float]:
    """Per turn: seconds the chat-completions route takes, body bytes in, response bytes out."""
    engine = StandInEngine(family, tok)
    state = ServerState(
        store=SessionStore(mode=mode),
        family=family,
        tokenizer=tok,
        engines=[engine],
        sampling=SamplingParams(max_new_tokens=64),
    )
    app = create_app(state)

    async def conversation(turns: int) -> list[float]:
        status, created = await asgi_post(app, "/sessions", b"")
        assert status == 201, created
        path = f"/sessions/{json.loads(created)['id']}/v1/chat/completions"
        engine.calls = 0
        messages: list[dict] = [dict(m) for m in FIRST]
        seconds = []
        for turn in range(turns):
            body = json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode()
            t0 = clock()
            status, response = await asgi_post(app, path, body)
            seconds.append(clock() - t0)
            assert status == 200, response[:500]
            # The agent replays the reply as it got it (like an SDK's message dump), then the tool result.
            messages += [json.loads(response)["choices"][0]["message"], tool_result(turn)]
        return seconds

    async def main() -> list[float]:
        await conversation(3)  # a fresh app builds some things on first use: not a cost per turn
        return await conversation(turns)

    return asyncio.run(main())


async def asgi_post(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` (JSON) to ``app`` in process, as an ASGI server would; returns status and body."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    delivered = False
    status, chunks = 0, []

    async def receive() -> dict:
        nonlocal delivered
        if delivered:
            return {"type": "http.disconnect"}
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


_outputs: dict[tuple[str, int], list[int]] = {}


def output_ids(family, tok, turn: int) -> list[int]:
    """The reply's tokens as the model would emit them (the template's rendering of it); cached."""
    key = (family.name, turn)
    if key not in _outputs:
        base = [{"role": "user", "content": "x"}]
        with_reply = family.render_ids(tok, [*base, reply(turn)], TOOLS, add_generation_prompt=False)
        ids = with_reply[len(family.render_ids(tok, base, TOOLS)) :]
        stops = set(family.stop_token_ids(tok))
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        _outputs[key] = ids[:end]
    return _outputs[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", choices=["linear", "branching"], default="linear")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument(
        "--stdlib-json",
        action="store_true",
        help="decode request bodies with json.loads instead of orjson (the A/B baseline of the route's decoder)",
    )
    args = parser.parse_args()
    if args.stdlib_json:
        from fastapi.routing import APIRoute

        from miles_envs.session_server import app as server_app

        server_app._OrjsonRoute.get_route_handler = APIRoute.get_route_handler  # FastAPI's own decoding
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    family = get_family(args.family)
    tok = family_tokenizer(family.name, family.artefacts)
    runs = []
    for _ in range(args.repeats + 1):  # the first run warms caches and is dropped
        tito, conversation = store_run(family, tok, args.turns, args.mode)
        retok = retokenize_run(family, tok, conversation, args.turns)
        runs.append((tito, retok, http_run(family, tok, args.turns, args.mode), os.getloadavg()[0]))
    runs = runs[1:]

    def per_turn(which: int, over: Any) -> list[float]:
        return [over(r[which][t] for r in runs) * 1e3 for t in range(args.turns)]

    fastest = {name: per_turn(i, min) for i, name in enumerate(("tito", "retokenize", "http"))}
    medians = {name: per_turn(i, statistics.median) for i, name in enumerate(("tito", "retokenize", "http"))}
    summary: dict[str, float] = {}
    for name, series in fastest.items():
        early, late = statistics.fmean(series[1:4]), statistics.fmean(series[-3:])
        slope, intercept = statistics.linear_regression(range(2, args.turns + 1), series[1:])
        summary |= {
            f"{name}_ms_turn2_4": early,
            f"{name}_ms_last3": late,
            f"{name}_last_over_early": late / early,
            f"{name}_fitted_last_over_early": (intercept + slope * (args.turns - 1))
            / (intercept + slope * 3),
        }
    print(", ".join(f"{k}={v:.3g}" for k, v in summary.items()))
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    name = "session_turn_cost" if args.mode == "linear" else f"session_turn_cost_{args.mode}"
    name += "_stdlib_json" if args.stdlib_json else ""
    with open(os.path.join(args.out, f"{name}_{stamp}.json"), "w") as f:
        json.dump(
            {
                "date": stamp,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "load_1min_per_run": [r[3] for r in runs],
                "args": vars(args),
                "summary": summary,
                "fastest_ms": fastest,
                "median_ms": medians,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
