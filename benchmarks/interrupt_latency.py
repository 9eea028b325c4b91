"""How long a stop takes: SIGINT (finish the step, save, exit), a second SIGTERM (stop at once), and
how long the resume takes to its first step.

    uv run python benchmarks/interrupt_latency.py [--rounds 2]

Runs ``miles run`` (the default recipe, small steps) as a subprocess in its own session, waits for
two logged steps, sends the signal(s) and times the exit; then runs ``--resume`` and times its
first new step. Also checks that no process of the run's session outlives it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MILES = os.path.join(os.path.dirname(sys.executable), "miles")
OVERRIDES = [
    "run.num_steps=500",
    "run.save_every=1000",  # no save is ever due: the one at the stop is the stop's own
    "run.export_hf=false",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "tracking.console=false",
]


def _rows(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def _start(out: Path, name: str, *extra: str) -> subprocess.Popen:
    args = [f"run.output_dir={out}", f"run.name={name}", *OVERRIDES]
    argv = [MILES, "run", *(a for o in args for a in ("--set", o)), *extra]
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _wait_rows(path: Path, n: int, proc: subprocess.Popen, timeout_s: float = 300) -> float:
    t0 = time.monotonic()
    while _rows(path) < n:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read() if proc.stderr else "ended early")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"no {n} steps in {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def _left(sid: int) -> int:
    out = subprocess.run(["ps", "-eo", "sid=,stat="], capture_output=True, text=True).stdout
    return sum(
        1 for line in out.splitlines() if line.split()[0] == str(sid) and not line.split()[1].startswith("Z")
    )


def one_round(out: Path, r: int) -> dict[str, float]:
    result: dict[str, float] = {}
    metrics = out / f"int{r}" / "metrics.jsonl"
    proc = _start(out, f"int{r}")
    result["start_to_first_step_s"] = _wait_rows(metrics, 1, proc)
    _wait_rows(metrics, 2, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    result["sigint_to_exit_s"] = time.monotonic() - t0
    result["sigint_exit_code"] = float(proc.returncode)
    time.sleep(2)
    result["processes_left_after_sigint"] = float(_left(proc.pid))
    done = _rows(metrics)
    state = json.loads((out / f"int{r}" / "checkpoints" / f"step_{done:06d}" / "state.json").read_text())
    result["checkpoint_holds_every_step"] = float(state["step"] == done)

    resumed = _start(out, f"int{r}", "--resume")
    result["resume_to_first_step_s"] = _wait_rows(metrics, done + 1, resumed)
    resumed.send_signal(signal.SIGTERM)
    assert resumed.stderr is not None
    for line in resumed.stderr:  # signals of one kind do not queue: send the second once seen
        if "stopping after the current step" in line:
            break
    t0 = time.monotonic()
    resumed.send_signal(signal.SIGTERM)
    resumed.wait(timeout=300)
    result["second_sigterm_to_exit_s"] = time.monotonic() - t0
    result["second_sigterm_exit_code"] = float(resumed.returncode)
    time.sleep(2)
    result["processes_left_after_sigterm"] = float(_left(resumed.pid))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the rounds' results here")
    args = p.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="miles-int-bench-") as tmp:
        for r in range(args.rounds):
            rounds.append(one_round(Path(tmp), r))
            print(json.dumps(rounds[-1]), flush=True)
    for key in rounds[0]:
        print(f"{key:32s} median {statistics.median(x[key] for x in rounds):8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "load": os.getloadavg()[0]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
