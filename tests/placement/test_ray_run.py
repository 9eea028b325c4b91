"""`miles run` attached to a running Ray cluster (`ray start --head`): trainer ranks and engines as actors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_fully_async_run_on_a_ray_cluster(ray_address: str, tmp_path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "miles",
        "run",
        "default",
        "--set", f"run.output_dir={tmp_path}",
        "--set", "warm_start=null",
        "--set", "eval=null",
        "--set", "rollout.reward=numeric_closeness",
        "--set", "train.lr=0.01",
        "--set", "run.num_steps=3",
        "--set", "run.export_hf=false",
        "--set", "rollout.prompts_per_step=4",
        "--set", "rollout.n_samples_per_prompt=4",
        "--set", "tracking.console=false",
        "--set", "weight_sync.check_equal=true",
        "--set", "schedule=fully_async",
        "--set", "placement.launcher=ray",
        "--set", f"placement.ray_address={ray_address}",
    ]  # fmt: skip
    env = {**os.environ, "MILES_DISABLE_PLUGINS": "broken"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        pytest.fail(f"the run did not finish in 400 s; its output:\n{out[-4000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("rollout/fully_async/queue_size" in r for r in rows)
    # The engine ran as a Ray actor's child: its log is where the launcher put it, and it served.
    logs = os.listdir(tmp_path / "default" / "engines")
    assert logs, "no engine log"
    assert rows[-1]["engine/weight_version"] == 3.0
