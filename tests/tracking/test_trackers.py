"""Each tracker against its real library (W&B offline, MLflow on a file store, a scraped Prometheus
endpoint), the guard that keeps a failing tracker from stopping a run, and the install check."""

from __future__ import annotations

import glob
import logging
import os
import threading
import time

import httpx
import pytest

from miles.config import load_recipe
from miles.config.loader import RecipeError
from miles.config.options import check_component_options
from miles.errors import ConfigError
from miles.tracking.base import NoOptions, TrackerContext
from miles.tracking.registry import GuardedTracker, build_tracker, check_trackers, selected_trackers


def _ctx(run_dir: str, first_step: int = 0) -> TrackerContext:
    return TrackerContext(
        run_dir=run_dir, run_name="t", num_steps=4, first_step=first_step, config={"run": {"name": "t"}}
    )


def test_wandb_offline_logs_every_step_and_a_resumed_run_continues_the_same_run(tmp_path, monkeypatch):
    from .wandb_records import history, run_ids, wait_for_exit

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path)
    first = build_tracker("wandb", _ctx(run_dir), {"mode": "offline", "project": "p"})
    first.log(0, {"rollout/reward_mean": 0.25, "train/loss": 1.5})
    first.log(1, {"rollout/reward_mean": 0.5})
    first.log_eval(0, {"eval/score": 0.125})
    first.close("interrupted")
    resumed = build_tracker("wandb", _ctx(run_dir, first_step=2), {"mode": "offline", "project": "p"})
    resumed.log(2, {"rollout/reward_mean": 0.75})
    resumed.close("completed")

    files = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb")))
    assert len(files) == 2
    for path in files:
        wait_for_exit(path)
    with open(os.path.join(run_dir, "wandb_run_id"), encoding="utf-8") as f:
        stored = f.read().strip()
    assert [run_ids(p) for p in files] == [[stored], [stored]]  # one W&B run, continued
    rows = [row for p in files for row in history(p)]
    by_step = {int(r["_step"]): r for r in rows}
    assert float(by_step[0]["train/loss"]) == 1.5
    assert [float(by_step[s]["rollout/reward_mean"]) for s in (0, 1, 2)] == [0.25, 0.5, 0.75]
    evals = [r for r in rows if "eval/score" in r]
    assert float(evals[0]["eval/score"]) == 0.125 and float(evals[0]["eval/step"]) == 0


def test_mlflow_file_store_keeps_metrics_by_step_across_a_resume(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = str(tmp_path)
    first = build_tracker("mlflow", _ctx(run_dir), {})
    first.log(0, {"rollout/reward_mean": 0.25, "engine/weight_version": 1, "bad": float("nan")})
    first.log(1, {"rollout/reward_mean": 0.5})
    first.close("interrupted")
    resumed = build_tracker("mlflow", _ctx(run_dir, first_step=2), {})
    resumed.log(2, {"rollout/reward_mean": 0.75})
    resumed.close("completed")

    assert resumed.run_id == first.run_id  # type: ignore[attr-defined]
    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    history = client.get_metric_history(first.run_id, "rollout/reward_mean")  # type: ignore[attr-defined]
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (0, 0.25),
        (1, 0.5),
        (2, 0.75),
    ]
    run = client.get_run(first.run_id)  # type: ignore[attr-defined]
    assert run.info.status == "FINISHED"
    assert run.data.metrics["engine/weight_version"] == 1.0
    assert "bad" not in run.data.metrics  # a NaN is not sent (MLflow's stores differ on it)


def test_prometheus_endpoint_serves_the_latest_step_over_http(tmp_path):
    tracker = build_tracker("prometheus", _ctx(str(tmp_path)), {"port": 0})
    try:
        tracker.log(3, {"rollout/reward_mean": 0.5, "time/step_s": 2.0})
        tracker.log(4, {"rollout/reward_mean": 0.75})
        with open(os.path.join(tmp_path, "prometheus_address"), encoding="utf-8") as f:
            address = f.read().strip()
        assert address.startswith("127.0.0.1:")
        text = httpx.get(f"http://{address}/metrics", timeout=10).text
    finally:
        tracker.close("completed")
    assert 'miles_rollout_reward_mean{run="t"} 0.75' in text
    assert 'miles_time_step_s{run="t"} 2.0' in text
    assert 'miles_step{run="t"} 4.0' in text
    with pytest.raises(httpx.TransportError):  # closed: the port is released
        httpx.get(f"http://{address}/metrics", timeout=2)


class _Broken:
    """A tracker whose backend dies after the first step."""

    Options = NoOptions
    requires = ()
    install = ""

    def __init__(self, ctx: TrackerContext, options: NoOptions) -> None:
        self.calls = 0

    def log(self, step, metrics):
        self.calls += 1
        if step >= 1:
            raise ConnectionError("tracking server went away")

    def log_eval(self, step, metrics):
        pass

    def close(self, status):
        pass


class _NeedsMissingLibrary(_Broken):
    requires = ("miles_tracker_lib_that_is_not_installed",)
    install = "miles-tracker-lib"


def test_a_failing_tracker_warns_once_and_is_switched_off(caplog):
    tracker = _Broken(_ctx("unused"), NoOptions())
    guarded = GuardedTracker("broken", tracker)
    with caplog.at_level(logging.WARNING, logger="miles.tracking"):
        for step in range(4):
            guarded.miles_on_metrics(step, {"x": 1.0})  # never raises
        guarded.close()
    warnings = [r for r in caplog.records if "broken" in r.getMessage()]
    assert len(warnings) == 1 and "tracking server went away" in warnings[0].getMessage()
    assert tracker.calls == 2  # not called again once it failed


def test_trackers_are_selected_by_name_and_a_missing_library_is_a_one_line_install_hint():
    config = load_recipe(
        "default", ["tracking.backends=[mlflow, prometheus, jsonl]", "tracking.console=false"]
    )
    assert selected_trackers(config) == ["jsonl", "tensorboard", "mlflow", "prometheus"]
    check_trackers(config)  # all installed here

    ref = f"{__name__}:_NeedsMissingLibrary"
    config = load_recipe("default", [f"tracking.backends=['{ref}']"])
    with pytest.raises(ConfigError) as err:
        check_trackers(config)
    message = str(err.value)
    assert "\n" not in message
    assert (
        "miles_tracker_lib_that_is_not_installed" in message and "pip install 'miles-tracker-lib'" in message
    )


def test_tracker_options_are_checked_against_the_trackers_model():
    ok = load_recipe("default", ["tracking.backends=[wandb]", "tracking.options.wandb.project=demo"])
    check_component_options(ok)
    bad = load_recipe("default", ["tracking.backends=[wandb]", "tracking.options.wandb.projekt=demo"])
    with pytest.raises(RecipeError, match="projekt"):
        check_component_options(bad)
    with pytest.raises(ConfigError, match=r"options for \['mlfow'\]"):
        check_trackers(
            load_recipe("default", ["tracking.backends=[mlflow]", "tracking.options.mlfow.experiment=x"])
        )
    with pytest.raises(Exception, match="did you mean"):
        check_trackers(load_recipe("default", ["tracking.backends=[wandbb]"]))


class _Slow(_Broken):
    """A tracker behind a slow network: every call takes 0.2 s; it records which thread ran it."""

    background = True

    def __init__(self, ctx: TrackerContext, options: NoOptions) -> None:
        self.steps: list[int] = []
        self.threads: set[str] = set()
        self.closed_after: list[int] | None = None

    def log(self, step, metrics):
        time.sleep(0.2)
        self.threads.add(threading.current_thread().name)
        if step == 3:
            raise TimeoutError("server too slow")
        self.steps.append(step)

    def close(self, status):
        self.closed_after = list(self.steps)


def test_a_background_tracker_never_holds_the_step_and_close_waits_for_it(caplog):
    tracker = _Slow(_ctx("unused"), NoOptions())
    guarded = GuardedTracker("slow", tracker)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="miles.tracking"):
        for step in range(5):
            guarded.miles_on_metrics(step, {"x": float(step)})
        handed_over = time.perf_counter() - t0
        guarded.close()
    assert handed_over < 0.15  # five calls of 0.2 s each, not waited for
    assert tracker.closed_after == [0, 1, 2]  # in order, drained before close; off after step 3 failed
    assert tracker.threads == {"miles-tracker-slow"}
    assert len([r for r in caplog.records if "server too slow" in r.getMessage()]) == 1
