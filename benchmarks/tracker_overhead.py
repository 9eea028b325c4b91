"""What the trackers cost a training step: every tracker together against JSONL alone.

    uv run python benchmarks/tracker_overhead.py [--steps 12] [--rounds 2]

Runs the built-in default recipe (CPU, in this process, as ``miles run`` does) ``--steps``
steps three ways: only the JSONL tracker; today's defaults (JSONL + TensorBoard + console);
and all of them + W&B (offline) + MLflow (file store) + Prometheus (a local endpoint) + the
rollout dump, alternating for ``--rounds`` rounds so a change in the machine's load hits
each. Reports the median ``time/step_s`` of each (step 0 left out: it holds one-off start-up
work) and the ratios all/JSONL and all/defaults.

On a shared machine the step-time ratio is noise-bound, so it also reports the trackers' own
time, which load blurs far less: the wall time of each step's ``miles_on_metrics`` hook (where
every tracker is called, on the driver thread) and the time of the rollout dump's hook, as a
share of the step. W&B and MLflow do part of their work on their own threads or process; that
part shows only in the step-time ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _bench import RESULTS_DIR, fmt, machine_info, write_result

ALL = [
    "tracking.tensorboard=true",
    "tracking.console=true",
    "tracking.backends=[wandb, mlflow, prometheus]",
    "tracking.options.wandb.mode=offline",
    "tracking.options.prometheus.port=0",
    "rollout.dump=true",
]
JSONL_ONLY = ["tracking.tensorboard=false", "tracking.console=false"]
# Today's defaults (JSONL, TensorBoard, console): what the new trackers add is ``all`` over this.
DEFAULTS = ["tracking.tensorboard=true", "tracking.console=true"]


def rl_only() -> list[str]:
    """The default recipe's RL loop as committed before it grew a warm start: no supervised stage
    first (150 steps that are not what is measured), the graded reward, so steps train."""
    from miles.config.schema import MilesConfig

    warm = ["warm_start=null"] if "warm_start" in MilesConfig.model_fields else []
    return [*warm, "eval=null", "rollout.reward=numeric_closeness"]


class HookClock:
    """Times the run's tracking hooks from outside: a wrapper around every implementation."""

    def __init__(self) -> None:
        self.metrics_s: list[float] = []
        self.dump_s: list[float] = []

    def install(self, pm: Any) -> None:
        from miles import hookimpl

        clock = self

        class _Wrap:
            @hookimpl(wrapper=True, tryfirst=True)
            def miles_on_metrics(self, step: int, metrics: dict[str, float]) -> Any:
                t0 = time.perf_counter()
                out = yield
                clock.metrics_s.append(time.perf_counter() - t0)
                return out

            @hookimpl(wrapper=True, tryfirst=True)
            def miles_rollout_postprocess(self, groups: Any, step: int) -> Any:
                t0 = time.perf_counter()
                out = yield
                clock.dump_s.append(time.perf_counter() - t0)
                return out

        self._plugin = _Wrap()
        pm.register(self._plugin, name="bench-hook-clock")

    def remove(self, pm: Any) -> None:
        pm.unregister(self._plugin)


def run_once(steps: int, settings: list[str], out_dir: str, extra: list[str]) -> dict[str, Any]:
    from miles.config import load_recipe
    from miles.loop import train
    from miles.plugins import get_plugin_manager

    config = load_recipe(
        "default",
        [
            f"run.output_dir={out_dir}",
            f"run.num_steps={steps}",
            "run.save_every=null",
            "run.export_hf=false",
            *rl_only(),
            *settings,
            *extra,
        ],
    )
    pm = get_plugin_manager()
    clock = HookClock()
    clock.install(pm)
    try:
        result = train(config)
    finally:
        clock.remove(pm)
    with open(result.metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    step_s = [r["time/step_s"] for r in rows if r["step"] > 0]
    # The hook of step s is timed after time/step_s was taken: it is the next step's cost.
    return {
        "step_s": step_s,
        "metrics_hook_s": clock.metrics_s[1:],
        "dump_hook_s": clock.dump_s[1:],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra KEY=VALUE overrides")
    args = p.parse_args(argv)
    os.environ.setdefault("WANDB_SILENT", "true")
    info = machine_info()
    arms = {"jsonl": JSONL_ONLY, "defaults": DEFAULTS, "all": ALL}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory(prefix="miles-tracker-bench-") as tmp:
        for r in range(args.rounds):
            for name, settings in arms.items():
                out = os.path.join(tmp, f"{name}{r}")
                runs[name].append(run_once(args.steps, settings, out, args.overrides))
                print(
                    f"round {r} {name}: median step {statistics.median(runs[name][-1]['step_s']):.3f} s",
                    flush=True,
                )

    def pooled(name: str, key: str) -> list[float]:
        return [v for run in runs[name] for v in run[key]]

    med = {name: statistics.median(pooled(name, "step_s")) for name in runs}
    ratio = med["all"] / med["jsonl"]
    ratio_defaults = med["all"] / med["defaults"]
    hooks = {name: statistics.median(pooled(name, "metrics_hook_s")) for name in runs}
    hooks_all, hooks_jsonl = hooks["all"], hooks["jsonl"]
    dump = statistics.median(pooled("all", "dump_hook_s")) if pooled("all", "dump_hook_s") else 0.0
    direct = (hooks_all - hooks_jsonl + dump) / med["jsonl"]
    result = {
        "benchmark": "tracker_overhead",
        "machine": info,
        "steps": args.steps,
        "rounds": args.rounds,
        "median_step_s": med,
        "ratio_all_over_jsonl": ratio,
        "ratio_all_over_defaults": ratio_defaults,
        "median_metrics_hook_s": hooks,
        "median_dump_hook_s": dump,
        "direct_overhead_share": direct,
        "runs": runs,
    }
    path = write_result(RESULTS_DIR / "tracker_overhead.json", result)
    print(
        f"median step: jsonl {fmt(med['jsonl'], 3)} s, defaults {fmt(med['defaults'], 3)} s, "
        f"all trackers {fmt(med['all'], 3)} s; all/jsonl {ratio:.3f}, all/defaults {ratio_defaults:.3f}\n"
        f"tracking hooks per step: jsonl {hooks_jsonl * 1e3:.2f} ms, defaults {hooks['defaults'] * 1e3:.2f} ms, "
        f"all {hooks_all * 1e3:.2f} ms, "
        f"dump {dump * 1e3:.2f} ms -> {direct:.2%} of a step\nwritten: {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
