"""Sandbox latency: create / exec / close of the local provider, and exec under concurrency.

Runs the provider with the isolation it detects (Linux namespaces here) and, side by side in the
same invocation, with ``isolation: none`` as the baseline, so the figures say what the isolation
itself costs: each namespaced exec builds a private root (about 25 small util-linux processes).
Medians over ``--repeats``; the concurrent figures are the wall time of one round in which N
sandboxes each run one command at once, and the exec throughput that gives.

    uv run python benchmarks/sandbox_latency.py [--repeats 30] [--out benchmarks/results/...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RESULTS_DIR, load_avg, machine_info

from miles_envs.sandbox import SandboxSpec, make_provider
from miles_envs.sandbox.base import SandboxProvider

SPEC = SandboxSpec(files={"task/README.md": "a starting file\n", "task/run.sh": "echo ok\n"})


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


async def single(provider: SandboxProvider, repeats: int) -> dict[str, float]:
    create, close = [], []
    execs: dict[str, list[float]] = {"true": [], "echo hello": [], "cat task/README.md": []}
    for _ in range(repeats):
        t = time.perf_counter()
        sb = await provider.create(SPEC)
        create.append(time.perf_counter() - t)
        for command, times in execs.items():
            t = time.perf_counter()
            result = await sb.exec(command)
            times.append(time.perf_counter() - t)
            assert result.ok, (command, result)
        t = time.perf_counter()
        await sb.close()
        close.append(time.perf_counter() - t)
    out = {"create_ms": _ms(create), "close_ms": _ms(close)}
    out.update({f"exec_{c.split()[0]}_ms": _ms(v) for c, v in execs.items()})
    return out


async def concurrent(provider: SandboxProvider, width: int, rounds: int) -> dict[str, float]:
    boxes = [await provider.create(SPEC) for _ in range(width)]
    try:
        walls = []
        for _ in range(rounds):
            t = time.perf_counter()
            results = await asyncio.gather(*(b.exec("echo hello") for b in boxes))
            walls.append(time.perf_counter() - t)
            assert all(r.ok for r in results)
    finally:
        for b in boxes:
            await b.close()
    wall = statistics.median(walls)
    return {"round_ms": round(wall * 1000, 1), "execs_per_s": round(width / wall, 1)}


async def measure(isolation: str, repeats: int) -> dict[str, Any]:
    provider = make_provider("local-dir", {"isolation": isolation})
    try:
        report = provider.describe()
        await single(provider, 3)  # warm the page cache and the interpreter's paths
        result: dict[str, Any] = {"isolation": report.kind, "detail": report.detail}
        result.update(await single(provider, repeats))
        result["concurrent"] = {
            str(n): await concurrent(provider, n, max(3, repeats // max(1, n // 2))) for n in (1, 4, 16)
        }
        return result
    finally:
        await provider.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "sandbox_latency.json")
    args = parser.parse_args()
    info = machine_info()
    runs = [asyncio.run(measure(iso, args.repeats)) for iso in ("auto", "none")]
    info["load_avg_at_end"] = load_avg()
    payload = {"machine": info, "repeats": args.repeats, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(
        f"{info['date']}, {info['nproc']} CPUs, load {info['load_avg_at_start']} -> {info['load_avg_at_end']}"
    )
    head = "| isolation | create | exec true | exec echo | exec cat | close | 1 | 4 | 16 concurrent (round ms, execs/s) |"
    print(head)
    for r in runs:
        conc = " | ".join(f"{c['round_ms']} ms, {c['execs_per_s']}/s" for c in r["concurrent"].values())
        print(
            f"| {r['isolation']} | {r['create_ms']} | {r['exec_true_ms']} | {r['exec_echo_ms']} | {r['exec_cat_ms']} "
            f"| {r['close_ms']} | {conc} |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
