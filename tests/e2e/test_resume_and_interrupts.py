"""Resumes that apply what may change and refuse what may not; SIGINT / SIGTERM stop at a safe point."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles import hookimpl
from miles.errors import ConfigError, RunComplete
from miles.loop import train
from miles.plugins import get_plugin_manager

pytestmark = pytest.mark.slow

MILES = os.path.join(os.path.dirname(sys.executable), "miles")


def _rows(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class _DiesAfter:
    """Raises KeyboardInterrupt (an abrupt stop, as kill -9 leaves it to --resume) after a step is logged."""

    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def miles_on_metrics(self, step, metrics):
        if step == self.step:
            raise KeyboardInterrupt("simulated kill")


def _tensorboard_steps(log_dir: str, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_resume_applies_changed_settings_refuses_fixed_ones_and_stops_when_complete(small_run, caplog):
    fixed = (
        "run.num_steps=4",
        "run.save_every=2",
        "run.export_hf=false",
        "run.name=resumed",
        "rollout.filters=[]",
    )
    killer = _DiesAfter(2)  # dies after step 2; the step-2 checkpoint (state.step=2) is the latest
    pm = get_plugin_manager()
    pm.register(killer)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(small_run(*fixed))
    finally:
        pm.unregister(killer)
    run_dir = Path(small_run(*fixed).run_dir)
    config_before = (run_dir / "config.yaml").read_text()

    # A setting the checkpoint depends on: refused, naming the key, before anything is written.
    with pytest.raises(ConfigError, match=r"model\.dtype: 'float32' -> 'bfloat16'"):
        train(small_run(*fixed, "model.dtype=bfloat16"), resume=True)
    assert (run_dir / "config.yaml").read_text() == config_before

    # The learning rate may change: it is the one the resumed steps train with.
    with caplog.at_level("INFO", logger="miles"):
        train(small_run(*fixed, "train.lr=0.02"), resume=True)
    assert "from checkpoint step_000002" in caplog.text
    assert "train.lr: 0.01 -> 0.02" in caplog.text
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["train/lr"] for r in rows] == pytest.approx([0.01, 0.01, 0.02, 0.02])
    assert "lr: 0.02" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "config_history" / "config.000.yaml").read_text() == config_before
    marker = json.loads((run_dir / "miles-run.json").read_text())
    assert marker["status"] == "completed" and marker["steps_done"] == 4
    assert marker["resumes"][0]["changed"] == {"train.lr": [0.01, 0.02]}
    # Step 2 ran twice (killed, then resumed): TensorBoard shows it once.
    assert _tensorboard_steps(str(run_dir / "tensorboard"), "train/lr") == [0, 1, 2, 3]
    assert [r["step"] for r in _rows(run_dir / "trained_prompts.jsonl")] == [0, 1, 2, 3]

    # Resuming the finished run starts nothing.
    t0 = time.perf_counter()
    with pytest.raises(RunComplete, match="already trained all 4 steps"):
        train(small_run(*fixed, "train.lr=0.02"), resume=True)
    assert time.perf_counter() - t0 < 5


def _start(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    args = [
        f"run.output_dir={tmp_path}",
        "run.name=sig",
        "run.num_steps=200",
        "run.export_hf=false",
        # The signals land in RL steps: no supervised warm start or evaluation to wait through first.
        "warm_start=null",
        "eval=null",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "tracking.console=false",
        *overrides,
    ]
    argv = [MILES, "run", *(a for o in args for a in ("--set", o))]
    # Its own session, so the test can check that no process of the run's outlives it.
    return subprocess.Popen(
        argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _wait_for_steps(path: Path, n: int, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(_rows(path)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {n} steps in {timeout_s} s")


def _session_processes(sid: int) -> list[str]:
    """Live processes of the run's session (a zombie is dead; only this container's init leaves it unreaped)."""
    out = subprocess.run(["ps", "-eo", "sid=,stat=,pid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [" ".join(r) for r in rows if r[0] == str(sid) and not r[1].startswith("Z")]


def _no_process_left(sid: int, timeout_s: float = 15) -> bool:
    """True once the session has no live process (a helper may take a moment to see its parent gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _session_processes(sid):
            return True
        time.sleep(0.5)
    raise AssertionError(f"still running {timeout_s} s after the run ended: {_session_processes(sid)}")


def test_sigint_finishes_the_step_saves_and_prints_the_resume_command(tmp_path):
    proc = _start(tmp_path, "run.save_every=1000")
    metrics = tmp_path / "sig" / "metrics.jsonl"
    _wait_for_steps(metrics, 2, proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Aborted" not in err and "never retrieved" not in err, err
    line = next(x for x in err.splitlines() if x.startswith("interrupted"))
    done = len(_rows(metrics))
    assert f"stopped after step {done} of 200" in line
    assert "miles run default" in line and "--resume" in line
    # A checkpoint was written at the stop (none was due), so the resume loses no step.
    state = json.loads((tmp_path / "sig" / "checkpoints" / f"step_{done:06d}" / "state.json").read_text())
    assert state["step"] == done
    assert json.loads((tmp_path / "sig" / "miles-run.json").read_text())["status"] == "interrupted"
    assert _no_process_left(proc.pid)


def test_a_second_sigterm_stops_at_once_with_no_process_left(tmp_path):
    proc = _start(tmp_path)
    _wait_for_steps(tmp_path / "sig" / "metrics.jsonl", 1, proc)
    proc.send_signal(signal.SIGTERM)
    # Signals of one kind do not queue: send the second once the first has been seen.
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "stopping after the current step" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    err = "".join(lines) + err
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    assert "stopped at once by SIGTERM" in err
    assert _no_process_left(proc.pid)


def test_a_start_up_failure_does_not_block_the_retry(small_run):
    from miles.errors import EngineError

    # The engine cannot become healthy in a millisecond: the run fails while starting up.
    with pytest.raises(EngineError, match="did not become healthy"):
        train(small_run("run.name=retry", "engine.startup_timeout_s=0.001"))
    config = small_run("run.name=retry", "run.num_steps=1", "run.export_hf=false")
    marker = json.loads((Path(config.run_dir) / "miles-run.json").read_text())
    assert marker["status"] == "failed" and marker["steps_done"] == 0
    assert (Path(config.run_dir) / "engines").is_dir()  # its logs are there to read until the retry
    train(config)  # neither --overwrite nor --resume needed: nothing in it was worth keeping
    assert [r["step"] for r in _rows(Path(config.run_dir) / "metrics.jsonl")] == [0]
