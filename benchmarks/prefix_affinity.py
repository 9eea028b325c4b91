"""Prefix-cache hit rate with session-affinity routing vs load-based routing over engine replicas.

    uv run python benchmarks/prefix_affinity.py [--engines 4] [--sessions 16] [--turns 8] [--repeats 3]

Workload: ``--sessions`` agent sessions run concurrently, ``--turns`` turns each, rendered with
the real tokenizer and chat template of ``--family`` (default qwen3). Turn 1 sends the
rendered system + user prompt (with the tool schema). Turn k+1 sends turn k's prompt ids,
then the engine's output ids, then the turn-end token (the model's reply is closed as a
real one would be), then a tool result rendered as the template's suffix
(``Family.suffix_ids``): every prompt extends the whole previous sequence of its session.
Between turns the session waits for its "tool" (log-normal, median ``--tool-latency-ms``,
drawn from a seed per session and turn), so sessions drift out of step as real agents do.
The default (1 s) is of the order of one turn's generation here. With much shorter tool
times the load baseline is flattered: a session that just finished freed a slot on its own
engine, so "least active" tends to send its next turn straight back there.
The engines are ``--engines`` embedded-engine replicas of one tiny random Qwen3 with the
tokenizer's vocabulary; it has no EOS, so every reply is exactly ``--max-new-tokens``
tokens and both policies see the same token counts.

Each repeat runs the workload twice against the same engines, routed by
:class:`miles.engines.router.Router` with ``policy="affinity"`` (a session's turns follow its
routing key) and with ``policy="load"`` (every turn goes to the least active engine), in
alternating order. Before each run the engines' caches are flushed, and every session's
system prompt starts with a tag unique to (repeat, policy), so no run is served from
another's cache.

Figures per run (``k`` ranges over every request of the run):

- ``hit_rate`` = sum_k min(cached_k, reusable_k) / sum_k reusable_k. ``cached_k`` is the
  engine's ``meta_info.cached_tokens``. ``reusable_k`` is the number of leading tokens of
  prompt k that the same session's previous turn already put through an engine and that
  an engine can hold the KV of: the previous turn's prompt and its output but the last
  output token (sampled, never fed back, so no engine computed its KV); 0 on a session's
  first turn. A perfect affinity router over caches that keep every session's prefix
  scores 1. The min keeps cache hits on what other sessions share (the template's opening
  tokens) from counting where the session had nothing of its own to reuse.
- ``cached_over_prompt`` = sum_k cached_k / sum_k prompt_k (no correction at all).
- ``prefilled_tokens`` = sum_k (prompt_k - cached_k): the prompt tokens engines computed.
- ``wall_s``: the whole workload; ``sessions_on_one_engine``: the fraction of sessions whose
  turns all reached one engine; ``requests_per_engine``.

The JSON goes to ``benchmarks/results/prefix_affinity.json``: every run, the median of each
figure per policy over the repeats, and the engines' cache statistics (the keys of
``/get_server_info`` that mention a cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _bench import RESULTS_DIR, machine_info, write_result  # noqa: E402

from miles.engines.client import SGLangClient  # noqa: E402
from miles.engines.launchers import EmbeddedLauncher  # noqa: E402
from miles.engines.router import POLICIES, Router  # noqa: E402
from miles.interfaces import EngineSpec  # noqa: E402
from miles.types import SamplingParams  # noqa: E402
from miles_envs.families import get_family  # noqa: E402
from miles_envs.families.artefacts import family_tokenizer  # noqa: E402

GOAL_HIT_RATE = 0.95
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web and return the top results.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "result",
    "page",
    "source",
    "cited",
    "found",
    "value",
    "table",
    "report",
    "figure",
    "measure",
    "sample",
    "error",
    "rate",
    "model",
    "engine",
    "cache",
    "prefix",
    "token",
    "session",
    "agent",
    "tool",
]


# ------------------------------------------------------------------ workload


@dataclass
class Script:
    """One session's token script: its first prompt, and the suffix appended after each reply."""

    key: str
    first_prompt: list[int]
    suffixes: list[list[int]]  # suffixes[k] follows turn k's reply; the last turn needs none
    tool_s: list[float]  # tool_s[k]: how long the tool called after turn k takes


def build_scripts(family: Any, tok: Any, args: argparse.Namespace, tag: str) -> list[Script]:
    """Every session's prompts, tokenized before the clock starts (the engines' outputs fill the gaps)."""
    stop_id = family.stop_token_ids(tok)[0]
    scripts = []
    for s in range(args.sessions):
        rng = random.Random(f"{tag}/{s}")
        messages = [
            {"role": "system", "content": f"[{tag} session {s}] You are a research agent. Use the tools."},
            {"role": "user", "content": f"Find out what {' '.join(rng.sample(WORDS, 4))} means."},
        ]
        suffixes, tool_s = [], []
        for turn in range(args.turns - 1):
            call_id = f"call_{turn}"
            previous = {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "search", "arguments": json.dumps({"q": f"query {turn}"})},
                    }
                ],
            }
            result = " ".join(rng.choice(WORDS) for _ in range(args.tool_words))
            tool = {"role": "tool", "tool_call_id": call_id, "content": f"result {turn}: {result}"}
            suffix = family.suffix_ids(tok, [tool], TOOLS, previous=previous, stop_id=stop_id)
            suffixes.append([stop_id, *suffix])  # close the model's reply, then the tool result
            tool_s.append(args.tool_latency_ms / 1000 * rng.lognormvariate(0.0, 1.0))
        scripts.append(Script(f"{tag}/s{s}", family.render_ids(tok, messages, TOOLS), suffixes, tool_s))
    return scripts


@dataclass
class Turn:
    session: int
    turn: int
    engine: int
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int


@dataclass
class Run:
    policy: str
    repeat: int
    wall_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    engine_cache_stats: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, num_engines: int) -> dict[str, Any]:
        reusable = sum(t.reusable_tokens for t in self.turns)
        hits = sum(min(t.cached_tokens, t.reusable_tokens) for t in self.turns)
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        engines_of: dict[int, set[int]] = {}
        for t in self.turns:
            engines_of.setdefault(t.session, set()).add(t.engine)
        return {
            "policy": self.policy,
            "repeat": self.repeat,
            "hit_rate": hits / reusable if reusable else None,
            "cached_over_prompt": cached / prompt if prompt else None,
            "prefilled_tokens": prompt - cached,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "reusable_tokens": reusable,
            "requests": len(self.turns),
            "wall_s": self.wall_s,
            "sessions_on_one_engine": sum(len(e) == 1 for e in engines_of.values()) / len(engines_of),
            "requests_per_engine": [sum(t.engine == i for t in self.turns) for i in range(num_engines)],
            "engine_cache_stats": self.engine_cache_stats,
        }


async def run_session(router: Router, script: Script, index: int, args: argparse.Namespace, run: Run) -> None:
    ids = list(script.first_prompt)
    previous: list[int] | None = None  # the session's last prompt + output
    for turn in range(args.turns):
        if previous is not None and ids[: len(previous)] != previous:  # the workload's own invariant
            raise AssertionError(f"session {index} turn {turn}: the prompt does not extend the last sequence")
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=index * 1000 + turn)
        async with router.request(script.key, sticky=True) as route:
            out = await route.generate(ids, params)
        if out.finish_reason == "abort" or out.prompt_tokens != len(ids):
            raise RuntimeError(f"session {index} turn {turn}: engine answered {out.finish_reason!r}")
        run.turns.append(
            Turn(
                session=index,
                turn=turn,
                engine=route.engine_index,
                prompt_tokens=len(ids),
                cached_tokens=out.cached_tokens,
                # Everything the previous turn fed through an engine except its last sampled token.
                reusable_tokens=0 if previous is None else len(previous) - 1,
            )
        )
        previous = ids + out.output_ids
        if turn < args.turns - 1:
            ids = previous + script.suffixes[turn]
            await asyncio.sleep(script.tool_s[turn])
    router.forget(script.key)


async def run_policy(
    clients: list[SGLangClient], scripts: list[Script], policy: str, repeat: int, args: argparse.Namespace
) -> Run:
    for client in clients:
        await client.flush_cache()
    router = Router(clients, policy=policy)
    run = Run(policy=policy, repeat=repeat)
    t0 = time.perf_counter()
    await asyncio.gather(*(run_session(router, s, i, args, run) for i, s in enumerate(scripts)))
    run.wall_s = time.perf_counter() - t0
    assert router.metrics()["router/active"] == 0
    for client in clients:
        info = await client.get_server_info()
        run.engine_cache_stats.append({k: v for k, v in info.items() if "cache" in k.lower()})
    return run


# ------------------------------------------------------------------ engines


def make_model(path: Path, vocab_size: int, max_positions: int) -> Path:
    """A tiny random Qwen3 with the tokenizer's vocabulary and no EOS (replies run to max_new_tokens)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


async def warm_up(clients: list[SGLangClient]) -> None:
    """One request per engine, so that no run pays for the engines' first forward passes."""
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    await asyncio.gather(*(c.generate(list(range(100, 164)), params) for c in clients))


async def measure(urls: list[str], family: Any, tok: Any, args: argparse.Namespace) -> list[Run]:
    clients = [SGLangClient(url, timeout=args.timeout_s) for url in urls]
    runs = []
    try:
        await warm_up(clients)
        for repeat in range(args.repeats):
            order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
            for policy in order:
                # Tags of one length, so that both policies' prompts have the same token counts.
                scripts = build_scripts(family, tok, args, tag=f"run {2 * repeat + POLICIES.index(policy)}")
                run = await run_policy(clients, scripts, policy, repeat, args)
                s = run.summary(len(clients))
                print(
                    f"repeat {repeat} {policy:>8}: hit rate {_pct(s['hit_rate'])}, cached/prompt "
                    f"{_pct(s['cached_over_prompt'])}, prefilled {s['prefilled_tokens']} of "
                    f"{s['prompt_tokens']} tokens, {s['wall_s']:.1f} s, per engine {s['requests_per_engine']}",
                    flush=True,
                )
                runs.append(run)
    finally:
        for client in clients:
            await client.aclose()
    return runs


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


# ------------------------------------------------------------------ main


MEDIAN_KEYS = ("hit_rate", "cached_over_prompt", "prefilled_tokens", "prompt_tokens", "wall_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tool-words", type=int, default=40, help="words per tool result")
    parser.add_argument(
        "--tool-latency-ms", type=float, default=1000.0, help="median tool time between turns"
    )
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--device", default="cpu", help="engine device: cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--max-batch-size", type=int, default=None, help="engine max_batch_size (default: its own)"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=str(RESULTS_DIR / "prefix_affinity.json"))
    args = parser.parse_args()
    for name in ("engines", "sessions", "turns", "repeats", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    family = get_family(args.family)
    tok = family_tokenizer(family.name, family.artefacts)
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", vocab_size=-(-len(tok) // 128) * 128, max_positions=8192)
        options: dict[str, Any] = {"device": args.device, "dtype": "float32", "torch_threads": 1}
        if args.max_batch_size is not None:
            options["max_batch_size"] = args.max_batch_size
        launcher = EmbeddedLauncher(startup_timeout_s=300)
        try:
            urls = launcher.launch(
                [EngineSpec(str(model), options=options)] * args.engines, os.path.join(tmp, "logs")
            )
            runs = asyncio.run(measure(urls, family, tok, args))
        finally:
            launcher.shutdown()

    summaries = [r.summary(args.engines) for r in runs]
    median = {
        policy: {
            key: statistics.median(s[key] for s in summaries if s["policy"] == policy and s[key] is not None)
            if any(s["policy"] == policy and s[key] is not None for s in summaries)
            else None
            for key in MEDIAN_KEYS
        }
        for policy in POLICIES
    }
    no_cache = all(s["cached_tokens"] == 0 for s in summaries)
    affinity_rate = median["affinity"]["hit_rate"]
    record = {
        "benchmark": "prefix_affinity",
        "machine": machine,
        "args": vars(args),
        "hit_rate_definition": "sum_k min(cached_k, reusable_k) / sum_k reusable_k; reusable_k = the session's "
        "previous prompt + output minus its last output token (0 on a first turn); see the script's docstring",
        "median": median,
        "goal_hit_rate": GOAL_HIT_RATE,
        "affinity_meets_goal": affinity_rate is not None and affinity_rate >= GOAL_HIT_RATE,
        "note": "the engines reported cached_tokens = 0 on every request: they keep no prefix cache"
        if no_cache
        else None,
        "runs": summaries,
    }
    path = write_result(args.out, record)
    for policy in POLICIES:
        m = median[policy]
        print(
            f"median {policy:>8}: hit rate {_pct(m['hit_rate'])}, cached/prompt {_pct(m['cached_over_prompt'])}, "
            f"prefilled {m['prefilled_tokens']} tokens, {m['wall_s']:.1f} s"
        )
    if no_cache:
        print("note: " + record["note"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
