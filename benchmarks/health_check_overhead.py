"""What the engine health checks cost a training step: the default recipe with them on and off.

    uv run python benchmarks/health_check_overhead.py [--steps 30] [--rounds 2] [--interval 2.0]

Runs the built-in default recipe (in this process, as ``miles run`` does) ``--steps`` steps with
``engine.health_check_interval_s`` at ``--interval`` (on; the default is 2 s) and at 0 (off: no
supervisor thread, no checks), alternating off/on for ``--rounds`` rounds so that a change in the
machine's load hits both. Reports the median ``time/step_s`` of each setting over all its runs
(step 0 left out: it includes the first weight update's check) and the ratio on/off. ``--interval
0.1`` shows the cost of checking twenty times as often as the default.

On a shared machine the step-time ratio is noise-bound, so it also reports the checks' own
cost, which load does not blur: the CPU time the supervisor thread spent on checks
(``engine/health_check_cpu_s``, measured with ``time.thread_time``) as a share of the run's
step time. That share is what the checks can take from the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def run_once(steps: int, interval: float, out_dir: str, extra: list[str]) -> tuple[list[float], float]:
    from miles.config import load_recipe
    from miles.loop import train

    config = load_recipe(
        "default",
        [
            f"run.output_dir={out_dir}",
            f"run.num_steps={steps}",
            "run.save_every=null",
            "run.export_hf=false",
            "tracking.console=false",
            "tracking.tensorboard=false",
            f"engine.health_check_interval_s={interval}",
            *extra,
        ],
    )
    result = train(config)
    with open(result.metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    check_cpu = float(rows[-1].get("engine/health_check_cpu_s", 0.0))
    return [r["time/step_s"] for r in rows if r["step"] > 0], check_cpu / sum(r["time/step_s"] for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interval", type=float, default=2.0, help="health-check interval when on (s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra KEY=VALUE overrides")
    args = p.parse_args(argv)

    steps: dict[str, list[float]] = {"off": [], "on": []}
    shares: list[float] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miles-hc-bench-") as tmp:
        for r in range(args.rounds):
            for label, interval in (("off", 0.0), ("on", args.interval)):
                out = os.path.join(tmp, f"{label}-{r}")
                times, share = run_once(args.steps, interval, out, args.overrides)
                steps[label].extend(times)
                if label == "on":
                    shares.append(share)
                print(
                    f"round {r} health checks {label:3s}: median step {statistics.median(times):.4f} s "
                    f"over {len(times)} steps",
                    flush=True,
                )
    off, on = statistics.median(steps["off"]), statistics.median(steps["on"])
    print(
        f"median step time: off {off:.4f} s, on (every {args.interval:g} s) {on:.4f} s; "
        f"ratio on/off {on / off:.4f} ({(on / off - 1) * 100:+.2f}%); "
        f"{args.rounds} rounds x {args.steps} steps, {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"health checks' own CPU time: {statistics.median(shares) * 100:.3f}% of step time "
        f"(median of {len(shares)} runs; max {max(shares) * 100:.3f}%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
