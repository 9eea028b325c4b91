"""The run directory's safety rules and atomic checkpoint commits."""

from __future__ import annotations

import os

import pytest

from miles.config import load_recipe
from miles.errors import ConfigError, RunDirError
from miles.run_dir import MARKER, LoopState, RunDir


def _ran(run: RunDir, steps: int = 1) -> None:
    """A run directory as a run that finished ``steps`` steps leaves it."""
    run.prepare(resume=False, overwrite=False)
    for name in ("metrics.jsonl", "config.yaml"):
        with open(run.sub(name), "w") as f:
            f.write("{}\n")
    os.makedirs(run.sub("engines"))
    run.update_marker(status="completed", steps_done=steps)


def test_existing_results_are_refused_without_a_flag(tmp_path):
    run = RunDir(str(tmp_path / "r"))
    _ran(run)
    with pytest.raises(RunDirError, match="--overwrite"):
        run.check(resume=False, overwrite=False)
    assert (tmp_path / "r" / "metrics.jsonl").exists()  # nothing was touched
    with pytest.raises(RunDirError, match="no complete checkpoint"):
        run.check(resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="contradict"):
        run.check(resume=True, overwrite=True)
    run.prepare(resume=False, overwrite=True)
    assert os.listdir(tmp_path / "r") == [MARKER]  # a fresh run's directory: only its marker


def test_overwrite_deletes_only_what_the_run_wrote(tmp_path):
    run = RunDir(str(tmp_path / "r"))
    _ran(run)
    os.makedirs(run.sub("plugin_output"))  # written by a plugin during the run: the marker records it
    run.update_marker(steps_done=2)
    (tmp_path / "r" / "my_notes.txt").write_text("mine")  # the user's, added after the run
    run.prepare(resume=False, overwrite=True)
    assert sorted(os.listdir(tmp_path / "r")) == [MARKER, "my_notes.txt"]
    assert (tmp_path / "r" / "my_notes.txt").read_text() == "mine"
    # ...and the user's file stays the user's in the new run's marker: a later overwrite keeps it too.
    run.prepare(resume=False, overwrite=True)
    assert (tmp_path / "r" / "my_notes.txt").read_text() == "mine"


def test_overwrite_never_deletes_a_directory_that_is_not_a_miles_run(tmp_path):
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("print('mine')")
    run = RunDir(str(project), output_dir=str(tmp_path))
    for resume, overwrite in ((False, False), (False, True)):
        with pytest.raises(RunDirError, match="not a Miles run directory"):
            run.prepare(resume=resume, overwrite=overwrite)
    assert (project / "src" / "train.py").read_text() == "print('mine')"


@pytest.mark.parametrize("name", [".", "..", "..."])
def test_dot_names_are_refused_before_anything_is_touched(tmp_path, name):
    out = tmp_path / "proj" / "runs"
    out.mkdir(parents=True)
    (tmp_path / "proj" / "keep.py").write_text("x")
    with pytest.raises(RunDirError, match="run name must not be"):
        RunDir(os.path.join(str(out), name), output_dir=str(out)).prepare(resume=False, overwrite=True)
    with pytest.raises(ConfigError, match=r"run\.name"):
        load_recipe("default", [f"run.name={name}", f"run.output_dir={out}"])
    assert (tmp_path / "proj" / "keep.py").exists()


def test_a_symlinked_run_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.bin").write_text("x")
    (tmp_path / "runs").mkdir()
    os.symlink(elsewhere, tmp_path / "runs" / "r")
    with pytest.raises(RunDirError, match="symbolic link"):
        RunDir(str(tmp_path / "runs" / "r"), output_dir=str(tmp_path / "runs")).prepare(
            resume=False, overwrite=True
        )
    assert (elsewhere / "data.bin").exists()


def test_a_run_that_failed_before_its_first_step_is_replaced_without_a_flag(tmp_path):
    run = RunDir(str(tmp_path / "r"))
    run.prepare(resume=False, overwrite=False)
    os.makedirs(run.sub("engines"))  # the failed start-up's engine logs
    run.update_marker(status="failed")
    with pytest.raises(RunDirError, match="never finished a step"):
        run.check(resume=True, overwrite=False)
    run.prepare(resume=False, overwrite=False)
    assert os.listdir(tmp_path / "r") == [MARKER]
    assert run.read_marker().status == "starting"


def test_a_resume_keeps_the_recipe_of_every_earlier_start(tmp_path):
    run = RunDir(str(tmp_path / "r"))
    _ran(run)
    run.keep_config_history()
    run.keep_config_history()
    assert sorted(os.listdir(run.sub("config_history"))) == ["config.000.yaml", "config.001.yaml"]
    run.record_resume(run.checkpoint_dir(4), {"train.lr": [0.01, 0.5]})
    assert run.read_marker().resumes[0]["changed"] == {"train.lr": [0.01, 0.5]}


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
