"""Bad input fails with one clear error before any process starts or anything is written."""

from __future__ import annotations

import pytest

from miles.config import load_recipe
from miles.errors import DataError, ModelError, RunDirError
from miles.loop import train


def _config(tmp_path, *overrides):
    return load_recipe(
        "default",
        [
            f"run.output_dir={tmp_path / 'runs'}",
            "tracking.console=false",
            "warm_start=null",
            "eval=null",
            # The RL settings these tests were written for (the default recipe's before its warm start).
            "rollout.reward=numeric_closeness",
            "train.lr=0.01",
            *overrides,
        ],
    )


def test_missing_dataset_file_fails_before_the_run_directory_exists(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl"):
        train(_config(tmp_path, f"data.path={tmp_path / 'nope.jsonl'}"))
    assert not (tmp_path / "runs").exists()


def test_bad_dataset_line_names_file_line_and_field(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n{"question": "2+2=", "label": "4"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl.*line 2.*prompt"):
        train(_config(tmp_path, f"data.path={data}"))
    assert not (tmp_path / "runs").exists()


def test_model_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "empty-model").mkdir()
    with pytest.raises(ModelError, match=r"config\.json"):
        train(_config(tmp_path, f"model.path={tmp_path / 'empty-model'}"))
    assert not (tmp_path / "runs").exists()


def test_earlier_results_are_refused_before_any_work(tmp_path):
    run_dir = tmp_path / "runs" / "default"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / "miles-run.json").write_text(
        '{"created": "2026-12-01", "status": "completed", "steps_done": 1}'
    )
    with pytest.raises(RunDirError, match="--resume"):
        train(_config(tmp_path, "model.path=/does/not/matter"))
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_overwrite_with_a_dot_run_name_deletes_nothing(tmp_path, monkeypatch):
    """The reported data loss: --overwrite with run.name=.. once removed the whole project."""
    from click.testing import CliRunner

    from miles.cli import cli

    project = tmp_path / "proj"
    (project / "runs").mkdir(parents=True)
    (project / "train.py").write_text("mine")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        cli, ["run", "--overwrite", "--set", "run.name=..", "--set", "run.output_dir=proj/runs"]
    )
    assert result.exit_code == 1
    assert "run.name" in result.output and "Traceback" not in result.output
    assert (project / "train.py").read_text() == "mine"
