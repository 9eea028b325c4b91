#!/usr/bin/env python3
"""Live check of a model family against a running engine (GPU): does the session-server rule hold?

The CPU check (``miles check-family``) proves the template is append-only for replies written
the way the template writes them. A real model writes its own tokens, and a real parser reads
them; this script checks that the rule survives that. It plays a tool-calling conversation
against an engine (SGLang, or Miles' embedded engine, through ``SGLangClient``) exactly as the
session server does — render the first turn, keep the engine's output ids, append
``suffix_ids(new messages)`` — and at every turn reports:

- ``stop``: the output ends with one of the family's stop tokens (the server's checkpoint must);
- ``parse``: the family's parsers read the output without errors (reasoning, tool calls);
- ``boundary``: the ids the server appends equal what the template writes after the reply when
  the whole conversation is rendered (the family's boundary rule, on the model's real reply);
- ``reply``: re-rendering the parsed reply gives back the model's own tokens. A difference here
  is informational: the server keeps the model's tokens, so training stays exact, but the model
  is conditioned on a history that a fresh render would spell differently.

Start an engine first, e.g. ``python -m sglang.launch_server --model-path Qwen/Qwen3-8B --port 30000``,
then ``python scripts/family-live-check.py --family qwen3 --engine-url http://127.0.0.1:30000
--tokenizer /path/to/Qwen3-8B``. Exits 1 if a stop, parse or boundary check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city. Always use it for weather questions.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]
QUESTIONS = [
    "What is the weather in Paris right now? Use the tool.",
    "And in Tokyo? Use the tool again.",
    "Which of the two cities is warmer? Answer in one sentence.",
    "Thanks. Now say goodbye in French.",
]
FAKE_WEATHER = {"paris": 18, "tokyo": 25}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--family", required=True, help="registered family name (miles check-family NAME)")
    parser.add_argument("--engine-url", required=True, help="a running engine, e.g. http://127.0.0.1:30000")
    parser.add_argument(
        "--tokenizer", help="the served model's tokenizer folder (default: the family's pinned one)"
    )
    parser.add_argument("--thinking", choices=["on", "off", "default"], default="default")
    parser.add_argument("--turns", type=int, default=6, help="engine calls to make (default 6)")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--system", default="You are a helpful assistant.", help="system prompt ('' for none)"
    )
    parser.add_argument("--json", action="store_true", help="print the per-turn results as JSON")
    return parser.parse_args(argv)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def tool_result(call: dict[str, Any]) -> str:
    try:
        city = str(json.loads(call["function"]["arguments"]).get("city", ""))
    except (json.JSONDecodeError, AttributeError):
        city = ""
    temp = FAKE_WEATHER.get(city.strip().lower(), 20)
    return json.dumps({"city": city, "temp_c": temp, "sky": "clear"})


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from miles.engines.client import SGLangClient
    from miles.types import SamplingParams
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer, load_tokenizer
    from miles_envs.families.base import encode

    family = get_family(args.family)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    elif family.artefacts is not None:
        tokenizer = family_tokenizer(family.name, family.artefacts)
    else:
        raise SystemExit(f"family {family.name!r} pins no tokenizer; pass --tokenizer")
    thinking = {"on": True, "off": False, "default": None}[args.thinking]
    stops = family.stop_token_ids(tokenizer)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=stops, seed=args.seed
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    questions = iter(QUESTIONS)
    messages.append({"role": "user", "content": next(questions)})
    ids = family.render_ids(tokenizer, messages, TOOLS, enable_thinking=thinking)
    client = SGLangClient(args.engine_url)
    results: list[dict[str, Any]] = []
    try:
        for turn in range(args.turns):
            out = await client.generate(list(ids), params)
            row: dict[str, Any] = {
                "turn": turn,
                "finish": out.finish_reason,
                "output_tokens": len(out.output_ids),
            }
            results.append(row)
            row["stop"] = bool(out.output_ids) and out.output_ids[-1] in stops
            parsed = family.parse_reply(tokenizer, out.output_ids, enable_thinking=thinking, tools=TOOLS)
            row["parse"] = parsed.status == "ok"
            row["parse_errors"] = parsed.errors
            row["tool_calls"] = [call["function"]["name"] for call in parsed.tool_calls]
            if not row["stop"]:
                row["note"] = "no stop token at the end (length limit?): the session would be truncated here"
                break
            reply = parsed.to_message()
            # reply: does the template spell the parsed reply as the model did?
            history_text = family.render_text(tokenizer, messages, TOOLS, enable_thinking=thinking)
            with_reply = family.render_text(
                tokenizer, [*messages, reply], TOOLS, add_generation_prompt=False, enable_thinking=thinking
            )
            end, _ = family.reply_end(with_reply, len(history_text), tokenizer)
            rendered_reply = encode(tokenizer, with_reply[len(history_text) : end])
            stop_text = family.reply_stop(reply)
            if stop_text is not None:
                rendered_reply.append(tokenizer.convert_tokens_to_ids(stop_text))
            diff = first_difference(rendered_reply, list(out.output_ids))
            row["reply"] = diff is None and with_reply.startswith(history_text)
            if diff is not None:
                row["reply_first_difference"] = diff
            messages.append(reply)
            if parsed.tool_calls:
                new = [
                    {
                        "role": "tool",
                        "tool_call_id": c["id"],
                        "name": c["function"]["name"],
                        "content": tool_result(c),
                    }
                    for c in parsed.tool_calls
                ]
            else:
                question = next(questions, None)
                if question is None:
                    break
                new = [{"role": "user", "content": question}]
            suffix = family.suffix_ids(
                tokenizer, new, TOOLS, enable_thinking=thinking, previous=reply, stop_id=out.output_ids[-1]
            )
            # boundary: the template's own continuation after this (real) reply
            full = family.render_text(tokenizer, [*messages, *new], TOOLS, enable_thinking=thinking)
            if not full.startswith(with_reply[:end]):
                row["boundary"] = False
                row["note"] = "rendering the whole conversation changes the text before the new messages"
            else:
                cut, consumed = family.reply_end(full, len(history_text), tokenizer)
                canonical = encode(tokenizer, full[cut + len(consumed or "") :])
                position = first_difference(canonical, suffix)
                row["boundary"] = position is None
                if position is not None:
                    row["boundary_first_difference"] = position
                    row["boundary_expected"] = tokenizer.decode(canonical[position : position + 8])
                    row["boundary_got"] = tokenizer.decode(suffix[position : position + 8])
            messages.extend(new)
            ids = list(ids) + list(out.output_ids) + suffix
    finally:
        await client.aclose()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    if args.json:
        print(json.dumps(results, indent=2, ensure_ascii=False))
    else:
        for row in results:
            checks = " ".join(
                f"{key}={'ok' if row.get(key) else 'FAIL'}"
                for key in ("stop", "parse", "boundary", "reply")
                if key in row
            )
            extra = f" tools={row['tool_calls']}" if row.get("tool_calls") else ""
            note = f"  ({row['note']})" if row.get("note") else ""
            print(
                f"turn {row['turn']}: {row['finish']:6} {row['output_tokens']:5} tokens  {checks}{extra}{note}"
            )
    failed = any(not row.get(key, True) for row in results for key in ("stop", "parse", "boundary"))
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
