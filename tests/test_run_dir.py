"""The run directory's safety rules and atomic checkpoint commits."""

from __future__ import annotations

import os

import pytest

from miles.errors import RunDirError
from miles.run_dir import LoopState, RunDir


def test_existing_results_are_refused_without_a_flag(tmp_path):
    run = RunDir(str(tmp_path / "r"))
    run.prepare(resume=False, overwrite=False)
    (tmp_path / "r" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match="--overwrite"):
        run.check(resume=False, overwrite=False)
    assert (tmp_path / "r" / "metrics.jsonl").exists()  # nothing was touched
    with pytest.raises(RunDirError, match="no complete checkpoint"):
        run.check(resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="contradict"):
        run.check(resume=True, overwrite=True)
    run.prepare(resume=False, overwrite=True)
    assert os.listdir(tmp_path / "r") == []


def test_half_written_checkpoint_is_ignored_and_latest_points_at_the_last_commit(tmp_path):
    run = RunDir(str(tmp_path / "r"))
    run.prepare(resume=False, overwrite=False)
    staging = run.staging_dir(2)
    run.commit_checkpoint(staging, 2, LoopState(step=2, weight_version=2, data_source={"offset": 8}), keep=2)
    run.staging_dir(4)  # a save killed before its commit: never visible
    latest = run.latest_checkpoint()
    assert latest is not None and latest.endswith("step_000002")
    assert RunDir.read_state(latest) == LoopState(step=2, weight_version=2, data_source={"offset": 8})
    for step in (4, 6, 8):
        run.commit_checkpoint(run.staging_dir(step), step, LoopState(step=step), keep=2)
    kept = sorted(d for d in os.listdir(run.checkpoints) if d.startswith("step_"))
    assert kept == ["step_000006", "step_000008"]
