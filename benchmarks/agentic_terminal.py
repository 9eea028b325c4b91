"""Terminal-task episodes: throughput with 1, 4 and 16 concurrent sandboxes, and an end-to-end run.

**Throughput** (no model): a *scripted shell agent* plays each built-in task. Its replies are fixed:
turn 1 runs the task's reference solution through the ``shell`` tool, turn 2 runs ``ls``, turn 3
answers "done". Everything else is the real episode path of the ``terminal`` agent
(``miles_envs.terminal.agent.solve``): a local-dir sandbox with the task's starting files (Linux
namespaces where available), the two commands, the hidden tests written and the test script run,
the sandbox closed. Each episode must score 1.0 (the solutions are correct), so a broken path
cannot post a number. ``--episodes`` episodes per width, ``width`` of them in flight at once.

**End to end** (``--e2e``): ``miles run`` of the ``terminal-tiny`` recipe (session server,
``terminal`` agent, fully asynchronous, 4 steps) and, from its ``metrics.jsonl``, each step's
``rollout/exit/<reason>`` counts and the agents' tool time. ``--e2e-model random`` runs the recipe
as shipped (the tiny random Qwen3 on all 24 tasks); ``trained`` serves the tiny model that
``tests/envs/shell_model.py`` trains to solve ``hello-file`` with the shell tool, over
``hello-file`` and three tasks it was not trained on (``E2E_TASKS``).

    uv run python benchmarks/agentic_terminal.py [--episodes 48] [--e2e] [--e2e-model random|trained]
        [--no-throughput] [--out benchmarks/results/agentic_terminal.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (
    REPO,
    RESULTS_DIR,
    load_avg,
    machine_info,
    miles_executable,
    read_metrics,
    run_timed,
    thread_env,
)

from miles.types import ExitReason
from miles_envs.sandbox import SandboxLimits
from miles_envs.terminal import PolicyReply, TerminalTask, load_tasks
from miles_envs.terminal.agent import TerminalAgentOptions, provider_for, solve
from miles_envs.terminal.episode import EpisodeOutcome, Policy

RECIPE = REPO / "packages/miles-envs/src/miles_envs/recipes/terminal-tiny.yaml"
LIMITS = SandboxLimits(wall_s=20.0, cpu_s=20, memory_bytes=512 << 20)


def scripted_agent(task: TerminalTask) -> Policy:
    """The fixed replies: the reference solution, ``ls``, then a final answer."""
    commands = [task.solution or "true", "ls"]
    turn = 0

    async def reply(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        nonlocal turn
        turn += 1
        if turn > len(commands):
            return PolicyReply({"role": "assistant", "content": "done"}, "stop", 1)
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "shell", "arguments": json.dumps({"command": commands[turn - 1]})},
        }
        return PolicyReply({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", 1)

    return reply


async def throughput(tasks: list[TerminalTask], width: int, episodes: int) -> dict[str, Any]:
    opts = TerminalAgentOptions(limits=dict(vars(LIMITS)), command_timeout_s=20.0)
    gate = asyncio.Semaphore(width)
    outcomes: list[EpisodeOutcome] = []
    walls: list[float] = []

    async def one(i: int) -> None:
        task = tasks[i % len(tasks)]
        async with gate:
            t0 = time.perf_counter()
            out = await solve(scripted_agent(task), task, opts)
            walls.append(time.perf_counter() - t0)
        if out.exit_reason is not ExitReason.COMPLETED or out.reward != 1.0:
            raise SystemExit(f"task {task.id}: the scripted episode did not pass: {out}")
        outcomes.append(out)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(episodes)))
    seconds = time.perf_counter() - t0
    return {
        "width": width,
        "episodes": episodes,
        "seconds": round(seconds, 2),
        "episodes_per_min": round(episodes / seconds * 60, 1),
        "episode_wall_median_s": round(statistics.median(walls), 3),
        "tool_time_median_s": round(statistics.median(o.tool_time_s for o in outcomes), 3),
        "load_avg_after": load_avg(),
    }


E2E_TASKS = ["hello-file", "count-lines", "grep-errors", "unique-names"]


def trained_overrides(out_dir: Path) -> list[str]:
    """Build the shell model (tests/envs/shell_model.py) and the recipe overrides that serve it."""
    sys.path.insert(0, str(REPO / "tests"))
    from envs.shell_model import build_shell_model

    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    model = build_shell_model(
        out_dir / "shell-model", family, family_tokenizer(family.name, family.artefacts)
    )
    sets = [
        f"model.path={model}",
        "agentic.family=qwen3",
        "data.system_prompt=null",
        f"data.options={{tasks: [{', '.join(E2E_TASKS)}]}}",
        "rollout.max_new_tokens=48",
        "train.lr=1e-6",
    ]
    return [arg for value in sets for arg in ("--set", value)]


def e2e(out_dir: Path, model: str) -> dict[str, Any]:
    extra = trained_overrides(out_dir) if model == "trained" else []
    cmd = [
        miles_executable(),
        "run",
        str(RECIPE),
        "--set",
        f"run.output_dir={out_dir}",
        "--overwrite",
        *extra,
    ]
    timed = run_timed(cmd, env=thread_env(1), timeout=900)
    if timed.returncode != 0:
        raise SystemExit(f"the e2e run failed ({timed.returncode}):\n{timed.stderr[-3000:]}")
    (metrics_file,) = out_dir.glob("*/metrics.jsonl")
    steps = []
    for row in read_metrics(metrics_file):
        steps.append(
            {
                "step": row["step"],
                "samples": row.get("rollout/samples"),
                "exit": {
                    k.removeprefix("rollout/exit/"): v
                    for k, v in row.items()
                    if k.startswith("rollout/exit/")
                },
                "tool_time_s_total": row.get("rollout/episode/tool_time_s_total"),
                "turns_mean": row.get("rollout/episode/turns_mean"),
                "reward_mean": row.get("rollout/reward_mean"),
                "rollout_s": row.get("time/rollout_s"),
            }
        )
    return {"model": model, "command": " ".join(cmd), "wall_s": round(timed.seconds, 1), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--widths", default="1,4,16")
    parser.add_argument("--e2e", action="store_true", help="also run the terminal-tiny recipe end to end")
    parser.add_argument("--e2e-model", choices=["random", "trained"], default="random")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--out", default=str(RESULTS_DIR / "agentic_terminal.json"))
    args = parser.parse_args()
    tasks = load_tasks("builtin")
    result: dict[str, Any] = {"machine": machine_info(), "tasks": len(tasks)}
    result["isolation"] = provider_for(TerminalAgentOptions()).describe().detail
    result["throughput"] = []
    for width in [] if args.no_throughput else [int(w) for w in args.widths.split(",")]:
        row = asyncio.run(throughput(tasks, width, args.episodes))
        print(json.dumps(row), flush=True)
        result["throughput"].append(row)
    if args.e2e:
        with tempfile.TemporaryDirectory() as tmp:
            result["e2e"] = e2e(Path(tmp), args.e2e_model)
        print(json.dumps(result["e2e"], indent=1), flush=True)
    result["machine"]["load_avg_at_end"] = load_avg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
