"""Session server cost per turn, turn 1 to 50, against re-tokenizing the whole history each turn.

    uv run python benchmarks/session_turn_cost.py [--family qwen3] [--turns 50] [--repeats 5]

A growing tool-calling conversation (user -> assistant tool call -> tool result -> ...). Per
turn, the token-in-token-out path is what the server does besides generating: plan the
request against the session (parse + match the replayed history), render only the new
messages (``suffix_ids``), parse the reply and commit the checkpoint. The baseline renders
and tokenizes the whole conversation (what a server without checkpoints must do). The
engine is left out of both; the "reply" is the family's own rendering of a fixed
tool-calling assistant message, so both paths see the same tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

from miles.families import get_family
from miles.families.artefacts import family_tokenizer
from miles.sessions import SessionStore

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


def one_run(family, tok, turns: int) -> tuple[list[float], list[float]]:
    store = SessionStore(mode="linear")
    session = store.create()
    messages: list[dict] = [
        {"role": "system", "content": "You are a research agent."},
        {"role": "user", "content": "Find X."},
    ]
    tito, retok = [], []
    for turn in range(turns):
        t0 = time.perf_counter()
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
        answer = reply(turn)
        output = out_ids_cache.setdefault(turn, _output_ids(family, tok, answer))  # the engine's stand-in
        t_out = time.perf_counter()
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
        t1 = time.perf_counter()
        tito.append((t_out - t0) + (t1 - t_out))
        messages += [
            parsed.to_message(),
            {
                "role": "tool",
                "tool_call_id": f"call_{turn}",
                "content": f"result {turn}: " + "lorem ipsum " * 20,
            },
        ]
        t2 = time.perf_counter()
        family.render_ids(tok, messages, TOOLS)
        retok.append(time.perf_counter() - t2)
    return tito, retok


out_ids_cache: dict[int, list[int]] = {}


def _output_ids(family, tok, answer: dict) -> list[int]:
    """The reply's tokens as the model would emit them (the template's rendering of it)."""
    base = [{"role": "user", "content": "x"}]
    with_reply = family.render_ids(tok, [*base, answer], TOOLS, add_generation_prompt=False)
    prompt = family.render_ids(tok, base, TOOLS)
    stops = set(family.stop_token_ids(tok))
    ids = with_reply[len(prompt) :]
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    family = get_family(args.family)
    tok = family_tokenizer(family.name, family.artefacts)
    runs = [one_run(family, tok, args.turns) for _ in range(args.repeats + 1)][1:]  # the first warms caches
    med = lambda xs: statistics.median(xs)  # noqa: E731
    tito = [med([r[0][t] for r in runs]) * 1e3 for t in range(args.turns)]
    retok = [med([r[1][t] for r in runs]) * 1e3 for t in range(args.turns)]
    first, last = statistics.fmean(tito[1:4]), statistics.fmean(tito[-3:])  # turn 1 is the full first render
    summary = {
        "tito_ms_turn2_4": first,
        "tito_ms_last3": last,
        "tito_last_over_early": last / first,
        "retokenize_ms_turn2_4": statistics.fmean(retok[1:4]),
        "retokenize_ms_last3": statistics.fmean(retok[-3:]),
        "retokenize_last_over_early": statistics.fmean(retok[-3:]) / statistics.fmean(retok[1:4]),
    }
    print(", ".join(f"{k}={v:.3g}" for k, v in summary.items()))
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    with open(os.path.join(args.out, f"session_turn_cost_{stamp}.json"), "w") as f:
        json.dump(
            {
                "date": stamp,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "args": vars(args),
                "summary": summary,
                "tito_ms": tito,
                "retokenize_ms": retok,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
