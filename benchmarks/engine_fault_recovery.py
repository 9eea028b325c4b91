"""Time to recover from each injected engine fault (kill -9 / SIGSTOP, mid-rollout / mid-update).

    uv run python benchmarks/engine_fault_recovery.py [--schedule sync|fully_async|both]

Runs the fault plans of ``tests/e2e/test_engine_faults.py`` (two embedded engines, disk-delta,
health checks every 0.2 s with a 1.5 s timeout; one fault per step, on real engine processes)
and prints, per fault: the step, what the run did, the time from detection to the engine serving
again (``engine/last_recovery_s``: restart, plus the catch-up to the fleet's weight version) and
that step's wall time. Detection itself takes at most one check interval for a dead process
(at once when a request finds it), and at most interval + timeout for a hung one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=["sync", "fully_async", "both"], default="both")
    args = p.parse_args(argv)

    from miles.config import load_recipe
    from tests.e2e import test_engine_faults as t

    plans = {
        "sync": (t.SYNC_FAULTS, ["run.num_steps=5"]),
        # The budget-breaking kill of the test is left out: this measures recoveries.
        "fully_async": (t.ASYNC_FAULTS[:2], ["run.num_steps=4", "schedule=fully_async"]),
    }
    chosen = list(plans) if args.schedule == "both" else [args.schedule]
    print("| schedule | fault | step | what the run did | detect -> serving (s) | step time (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="miles-fault-bench-") as tmp:
        for schedule in chosen:
            faults, extra = plans[schedule]
            base = [
                f"run.output_dir={os.path.join(tmp, schedule)}",
                "rollout.prompts_per_step=4",
                "rollout.n_samples_per_prompt=4",
                "tracking.console=false",
                "run.save_every=1",
                f"rollout.generate_fn={t.__name__}:faulty_generate",
                *t.FAST,
                *extra,
            ]
            outcome = t._run(load_recipe("default", base), t.Plan([dataclasses.replace(f) for f in faults]))
            if outcome.error is not None:
                print(f"{schedule}: the run failed: {outcome.error}")
                continue
            rows = {r["step"]: r for r in outcome.rows}
            for fault in outcome.plan.faults:
                row = rows[fault.step]
                did = "update recovered from a snapshot" if row.get("weight_sync/recovered") else "continued"
                did = f"requests retried: {row['engine/retried_requests']:.0f} so far; {did}"
                name = f"{signal.Signals(fault.sig).name} engine {fault.engine} mid-{fault.where}"
                print(
                    f"| {schedule} | {name} | {fault.step} | {did} | "
                    f"{row.get('engine/last_recovery_s', float('nan')):.1f} | {row['time/step_s']:.1f} |"
                )
            print(f"| {schedule} | (run: {len(rows)} steps, {outcome.seconds:.0f} s end to end) | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
