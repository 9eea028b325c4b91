"""The three modes against real embedded engines: shared, a dedicated fleet, an external backend."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from eval.helpers import PROBE, HFExport, make_config, pause_production, version_dropping_proxy
from miles.engines.client import SyncEngineClient
from miles.eval import Evaluator
from miles.eval.result import VERSION_MISMATCH

N_PROMPTS, N_SAMPLES = 4, 2  # the eval file and make_config


def _evaluator(config, model_dir: Path, tokenizer, run_dir: Path, *, engine_urls=(), export=None, lock=None):
    def no_export(directory: str) -> None:
        raise AssertionError("shared mode must not export")

    return Evaluator(
        config,
        model_path=str(model_dir),
        tokenizer=tokenizer,
        run_dir=str(run_dir),
        engine_urls=list(engine_urls),
        export_snapshot=export or no_export,
        pause_production=pause_production,
        weights_lock=lock or threading.Lock(),
    )


def _wait_results(ev: Evaluator, step: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = ev.collect(step)
        if results:
            return results
        time.sleep(0.05)
    raise AssertionError("no evaluation result in time")


def _set_version(url: str, version: int) -> None:
    with SyncEngineClient(url) as client:
        client.update_weight_version(version)


@pytest.fixture(scope="module")
def snapshot_model(model_dir: Path):
    """The "trained" policy: the test model with different weights, exported as the backend would."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return model


# ------------------------------------------------------------------------- shared


def test_shared_sync_runs_inline_under_the_weights_lock_and_paused_production(
    tmp_path, model_dir, data_file, tokenizer, engine_url
) -> None:
    _set_version(engine_url, 3)  # the driver just pushed the weights of step 2
    lock = threading.Lock()
    PROBE.reset(lock)
    config = make_config(tmp_path, model_dir, data_file, mode="shared", reward_options={"value": 0.25})
    with _evaluator(
        config, model_dir, tokenizer, tmp_path / "run", engine_urls=[engine_url], lock=lock
    ) as ev:
        ev.start(2)
        # Sync schedule: the evaluation is over when start() returns; lock and production are released.
        assert not lock.locked() and not PROBE.paused
        [result] = ev.collect(2)
    assert len(PROBE.calls) == N_PROMPTS * N_SAMPLES
    assert all(c["lock_held"] and c["paused"] for c in PROBE.calls)
    assert {c["thread"] for c in PROBE.calls} == {"miles-eval-loop"}
    assert all(c["versions"] and set(c["versions"]) == {3} for c in PROBE.calls)
    assert (result.step, result.weight_version, result.mode, result.status) == (2, 3, "shared", "ok")
    assert result.delay_steps == 0
    assert result.metrics["score"] == pytest.approx(0.25) and result.metrics["pass_rate"] == 0.0
    assert result.metrics["n_samples"] == N_PROMPTS * N_SAMPLES
    assert result.mean_weight_version == 3.0 and result.mixed_version_fraction == 0.0
    [row] = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert row["step"] == 2 and row["status"] == "ok" and row["metrics"]["score"] == pytest.approx(0.25)


def test_shared_engine_on_another_version_is_a_mismatch(
    tmp_path, model_dir, data_file, tokenizer, engine_url
) -> None:
    _set_version(engine_url, 3)
    config = make_config(tmp_path, model_dir, data_file, mode="shared")
    with _evaluator(config, model_dir, tokenizer, tmp_path / "run", engine_urls=[engine_url]) as ev:
        ev.start(3)  # expects version 4: the update did not reach the engine
        [result] = ev.collect(3)
    assert result.reason == VERSION_MISMATCH and "reports 3" in result.message
    assert not PROBE.calls  # nothing was sampled on the wrong weights


def test_shared_fully_async_runs_in_the_background_and_holds_back_weight_updates(
    tmp_path, model_dir, data_file, tokenizer, engine_url
) -> None:
    _set_version(engine_url, 6)
    lock = threading.Lock()
    PROBE.reset(lock)
    config = make_config(
        tmp_path, model_dir, data_file, mode="shared", schedule="fully_async", reward_options={"delay_s": 0.1}
    )
    with _evaluator(
        config, model_dir, tokenizer, tmp_path / "run", engine_urls=[engine_url], lock=lock
    ) as ev:
        ev.start(5)
        assert lock.locked()  # returned at once; the evaluation holds the lock
        with lock:  # the driver's next weight update waits for the evaluation
            acquired = time.monotonic()
            assert len(PROBE.calls) == N_PROMPTS * N_SAMPLES
        [result] = _wait_results(ev, 6)
    assert max(c["time"] for c in PROBE.calls) < acquired
    assert all(c["lock_held"] and c["paused"] for c in PROBE.calls)
    assert (result.step, result.status, result.delay_steps, result.mean_weight_version) == (5, "ok", 1, 6.0)


# ------------------------------------------------------------------------- dedicated


@pytest.mark.slow
def test_dedicated_fleet_loads_the_snapshot_and_verifies_its_version(
    tmp_path, model_dir, data_file, tokenizer, snapshot_model
) -> None:
    export = HFExport(snapshot_model, model_dir)
    config = make_config(
        tmp_path, model_dir, data_file, mode="dedicated", engine_options={"dtype": "float32"}
    )
    with _evaluator(config, model_dir, tokenizer, tmp_path / "run", export=export) as ev:
        assert len(ev.fleet_urls) == 1
        ev.start(4)
        assert export.calls == [str(tmp_path / "run" / "eval_snapshots" / "v5")]
        [result] = _wait_results(ev, 6)
        with SyncEngineClient(ev.fleet_urls[0]) as fleet:
            assert fleet.weight_version() == 5
    assert (result.step, result.weight_version, result.mode, result.status) == (4, 5, "dedicated", "ok"), (
        result
    )
    assert result.delay_steps == 2
    assert result.mean_weight_version == 5.0 and result.mixed_version_fraction == 0.0
    assert result.metrics["n_samples"] == N_PROMPTS * N_SAMPLES and "export_s" in result.metrics
    assert not Path(export.calls[0]).exists()  # the snapshot is deleted once scored
    assert (tmp_path / "run" / "eval_engines" / "engine-0.log").is_file()


def test_dedicated_engine_that_keeps_its_old_version_is_a_mismatch(
    tmp_path, model_dir, data_file, tokenizer, engine_url, snapshot_model
) -> None:
    _set_version(engine_url, 1)
    export = HFExport(snapshot_model, model_dir)
    with version_dropping_proxy(engine_url) as proxy:
        config = make_config(tmp_path, model_dir, data_file, mode="dedicated", engine_options={"url": proxy})
        with _evaluator(config, model_dir, tokenizer, tmp_path / "run", export=export) as ev:
            ev.start(1)
            [result] = _wait_results(ev, 1)
    assert result.reason == VERSION_MISMATCH, result
    assert f"{proxy} reports 1" in result.message
    assert not PROBE.calls  # never scored
    assert not Path(export.calls[0]).exists()


# ------------------------------------------------------------------------- external


@pytest.mark.slow
def test_external_embedded_engine_backend_scores_the_checkpoint(
    tmp_path, model_dir, data_file, tokenizer, snapshot_model
) -> None:
    export = HFExport(snapshot_model, model_dir)
    options = {
        "data": {"path": str(data_file), "apply_chat_template": False},
        "reward": "eval.helpers:ProbeReward",
        "reward_options": {"value": 1.0},
        "max_prompts": 3,
        "max_new_tokens": 2,
        "engine_options": {"torch_threads": 1, "dtype": "float32"},
    }
    config = make_config(
        tmp_path,
        model_dir,
        data_file,
        mode="external",
        backend="miles.eval.external:EmbeddedEngineEval",
        backend_options=options,
    )
    with _evaluator(config, model_dir, tokenizer, tmp_path / "run", export=export) as ev:
        ev.start(6)
        [result] = _wait_results(ev, 7)
    assert (result.step, result.weight_version, result.mode, result.status) == (6, 7, "external", "ok"), (
        result
    )
    assert result.metrics["score"] == 1.0 and result.metrics["pass_rate"] == 1.0
    assert result.metrics["n_samples"] == 3  # max_prompts 3, one sample each
    assert result.mean_weight_version == 7.0 and result.mixed_version_fraction == 0.0
    assert all(set(c["versions"]) == {7} for c in PROBE.calls)
    assert not Path(export.calls[0]).exists()
