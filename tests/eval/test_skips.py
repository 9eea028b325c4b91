"""Each reason a snapshot evaluation is skipped; training (the caller) never sees an exception.

These run mode ``external`` with user backends given by import path, so no engine is needed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from eval.helpers import GATE, SEEN, empty_export, failing_export, make_config, pause_production
from miles.eval import Evaluator
from miles.eval.result import (
    BACKEND_ERROR,
    EXPORT_FAILED,
    MISSING_SNAPSHOT,
    TIMEOUT,
    TOO_MANY_OUTSTANDING,
    VERSION_MISMATCH,
)


def _copy_export(model_dir: Path):
    """An export that writes a real (tiny) Hugging Face checkpoint: the test model's files."""
    import shutil

    calls: list[str] = []

    def export(directory: str) -> None:
        calls.append(directory)
        shutil.copytree(model_dir, directory)

    export.calls = calls  # type: ignore[attr-defined]
    return export


def _evaluator(tmp_path: Path, model_dir: Path, data_file: Path, export, **eval_) -> Evaluator:
    config = make_config(tmp_path, model_dir, data_file, mode="external", **eval_)
    return Evaluator(
        config,
        model_path=str(model_dir),
        tokenizer=None,
        run_dir=str(tmp_path / "run"),
        engine_urls=[],
        export_snapshot=export,
        pause_production=pause_production,
        weights_lock=threading.Lock(),
    )


def _wait_results(ev: Evaluator, step: int, n: int = 1, timeout: float = 20.0) -> list:
    results: list = []
    deadline = time.monotonic() + timeout
    while len(results) < n and time.monotonic() < deadline:
        results += ev.collect(step)
        time.sleep(0.02)
    assert len(results) >= n, f"got {len(results)} results, expected {n}"
    return results


def _rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_export_that_raises_is_skipped(tmp_path, model_dir, data_file, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="miles.eval")
    with _evaluator(
        tmp_path, model_dir, data_file, failing_export, backend="eval.helpers:GatedBackend"
    ) as ev:
        ev.start(3)  # must not raise
        [result] = ev.collect(3)
    assert (result.step, result.weight_version, result.status, result.reason) == (
        3,
        4,
        "skipped",
        EXPORT_FAILED,
    )
    assert "No space left on device" in result.message and result.delay_steps == 0
    assert not SEEN  # the backend was never called
    assert not (tmp_path / "run" / "eval_snapshots" / "v4").exists()
    assert "skipped: export_failed" in caplog.text
    assert _rows(tmp_path)[0]["reason"] == EXPORT_FAILED


def test_export_without_a_checkpoint_is_a_missing_snapshot(tmp_path, model_dir, data_file) -> None:
    with _evaluator(tmp_path, model_dir, data_file, empty_export, backend="eval.helpers:GatedBackend") as ev:
        ev.start(0)
        [result] = ev.collect(0)
    assert result.reason == MISSING_SNAPSHOT and "config.json" in result.message
    assert not SEEN and not (tmp_path / "run" / "eval_snapshots" / "v1").exists()


def test_raising_backend_is_a_backend_error(tmp_path, model_dir, data_file) -> None:
    export = _copy_export(model_dir)
    with _evaluator(tmp_path, model_dir, data_file, export, backend="eval.helpers:RaisingBackend") as ev:
        ev.start(1)
        [result] = _wait_results(ev, 2)
    assert (result.step, result.reason, result.delay_steps) == (1, BACKEND_ERROR, 1)
    assert "judge service unreachable" in result.message and "ConnectionError" in result.message
    assert not Path(export.calls[0]).exists()  # the snapshot is deleted after a failure too


def test_more_outstanding_than_allowed_is_skipped_without_export(tmp_path, model_dir, data_file) -> None:
    export = _copy_export(model_dir)
    opts = {"score": 0.5, "mean_weight_version_offset": 0.0}
    with _evaluator(
        tmp_path,
        model_dir,
        data_file,
        export,
        backend="eval.helpers:GatedBackend",
        backend_options=opts,
        max_outstanding=1,
    ) as ev:
        ev.start(4)
        deadline = time.monotonic() + 10
        while not SEEN and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ev.outstanding == 1
        ev.start(5)  # one still running, max_outstanding 1: skipped at once, never queued
        [skipped] = ev.collect(5)
        assert (skipped.step, skipped.reason) == (5, TOO_MANY_OUTSTANDING)
        assert len(export.calls) == 1  # no export for the skipped one
        GATE.set()
        [done] = _wait_results(ev, 7)
    assert (done.step, done.weight_version, done.status, done.delay_steps) == (4, 5, "ok", 3)
    assert done.metrics["score"] == 0.5 and "export_s" in done.metrics
    assert done.mean_weight_version == 5.0 and done.mixed_version_fraction == 0.0
    # The backend got a real checkpoint directory and the recipe's options; it is gone afterwards.
    assert SEEN[0]["has_config"] and SEEN[0]["step"] == 4 and SEEN[0]["version"] == 5
    assert SEEN[0]["options"] == opts
    assert not Path(export.calls[0]).exists()
    assert [(r["step"], r["status"], r["delay_steps"]) for r in _rows(tmp_path)] == [
        (5, "skipped", 0),
        (4, "ok", 3),
    ]


def test_backend_reporting_another_version_is_a_mismatch(tmp_path, model_dir, data_file) -> None:
    GATE.set()
    opts = {"mean_weight_version_offset": -1.0}
    with _evaluator(
        tmp_path,
        model_dir,
        data_file,
        _copy_export(model_dir),
        backend="eval.helpers:GatedBackend",
        backend_options=opts,
    ) as ev:
        ev.start(2)
        [result] = _wait_results(ev, 2)
    assert result.reason == VERSION_MISMATCH and result.mean_weight_version == 2.0
    assert result.metrics == {"score": 0.5}


def test_backend_past_the_timeout_is_skipped_and_exit_does_not_hang(tmp_path, model_dir, data_file) -> None:
    export = _copy_export(model_dir)
    with _evaluator(
        tmp_path, model_dir, data_file, export, backend="eval.helpers:GatedBackend", timeout_s=0.3
    ) as ev:
        ev.start(0)
        [result] = _wait_results(ev, 0)
        assert result.reason == TIMEOUT
        assert Path(export.calls[0]).exists()  # still in the backend's hands
        GATE.set()
    assert not Path(export.calls[0]).exists()


def test_exit_waits_for_outstanding_evaluations(tmp_path, model_dir, data_file) -> None:
    threading.Timer(0.3, GATE.set).start()
    with _evaluator(
        tmp_path, model_dir, data_file, _copy_export(model_dir), backend="eval.helpers:GatedBackend"
    ) as ev:
        ev.start(9)
        assert ev.collect(9) == []
    [result] = ev.collect(9)
    assert result.status == "ok" and result.step == 9 and result.delay_steps == 0
    assert _rows(tmp_path)[0]["status"] == "ok"


def test_due_follows_every_and_the_last_step(tmp_path, model_dir, data_file) -> None:
    ev = _evaluator(
        tmp_path, model_dir, data_file, failing_export, backend="eval.helpers:GatedBackend", every=3
    )
    assert [s for s in range(10) if ev.due(s)] == [2, 5, 8, 9]


def test_bad_backend_name_fails_at_construction(tmp_path, model_dir, data_file) -> None:
    from miles.errors import ComponentError

    with pytest.raises(ComponentError, match="NoSuchBackend"):
        _evaluator(tmp_path, model_dir, data_file, failing_export, backend="eval.helpers:NoSuchBackend")
