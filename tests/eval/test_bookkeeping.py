"""Version bookkeeping: which step a score belongs to, how late it came, and the two version checks."""

from __future__ import annotations

import json
import math

import pytest

from miles.eval import EvalResult, EvalSkipped
from miles.eval.external import backend_metrics
from miles.eval.result import BACKEND_ERROR, VERSION_MISMATCH, EvalLog
from miles.eval.scoring import EvalScore, summarize
from miles.eval.versions import version_stats
from miles.types import Prompt, Sample, Status


def _sample(versions: list[int], reward: float = 1.0, status: Status = Status.COMPLETED) -> Sample:
    return Sample(
        prompt=Prompt(index=0, prompt="p"),
        response_ids=list(range(len(versions))),
        weight_versions=list(versions),
        reward=reward,
        status=status,
    )


def test_samples_on_the_expected_version_pass() -> None:
    stats = version_stats([_sample([4, 4, 4]), _sample([4])], 4)
    assert stats.mean_weight_version == 4.0
    assert stats.mixed_version_fraction == 0.0
    stats.check(4)


def test_a_sample_spanning_two_versions_is_a_mismatch() -> None:
    samples = [_sample([4, 4]), _sample([3, 4]), _sample([4, 4, 4]), _sample([4])]
    stats = version_stats(samples, 4)
    assert stats.mixed_version_fraction == 0.25
    assert stats.mean_weight_version == pytest.approx(31 / 8)
    with pytest.raises(EvalSkipped) as err:
        stats.check(4)
    assert err.value.reason == VERSION_MISMATCH
    assert err.value.mixed_version_fraction == 0.25
    assert err.value.mean_weight_version == pytest.approx(31 / 8)


def test_versions_that_average_out_are_still_a_mismatch() -> None:
    # Tokens from v-1 and v+1 average to v: the mean check alone would accept this score.
    stats = version_stats([_sample([3, 3]), _sample([5, 5])], 4)
    assert stats.mean_weight_version == 4.0
    assert stats.mixed_version_fraction == 1.0
    with pytest.raises(EvalSkipped, match=r"100\.0% of the eval samples"):
        stats.check(4)


def test_no_tokens_cannot_be_tied_to_a_version() -> None:
    stats = version_stats([_sample([])], 4)
    assert stats.mean_weight_version is None
    with pytest.raises(EvalSkipped, match="no eval token"):
        stats.check(4)


def test_score_keeps_its_metrics_when_the_version_check_fails() -> None:
    samples = [_sample([2, 2], reward=1.0), _sample([2, 3], reward=0.0)]
    score = EvalScore(
        metrics=summarize(samples), versions=version_stats(samples, 2), aborted=0, samples=samples
    )
    assert (
        score.metrics["score"] == 0.5
        and score.metrics["pass_rate"] == 0.5
        and score.metrics["n_samples"] == 2
    )
    with pytest.raises(EvalSkipped) as err:
        score.check(2)
    assert err.value.reason == VERSION_MISMATCH and err.value.metrics["score"] == 0.5


def test_aborted_eval_samples_make_the_score_incomplete() -> None:
    samples = [_sample([2]), _sample([2], status=Status.ABORTED, reward=0.0)]
    score = EvalScore(
        metrics=summarize(samples), versions=version_stats(samples, 2), aborted=1, samples=samples
    )
    with pytest.raises(EvalSkipped, match="aborted 1 of 2") as err:
        score.check(2)
    assert err.value.reason == "engine_error"


def test_result_is_recorded_against_the_measured_step_with_its_delay(tmp_path) -> None:
    result = EvalResult(
        step=4,
        weight_version=5,
        mode="dedicated",
        status="ok",
        metrics={"score": 0.75, "n_samples": 8.0},
        mean_weight_version=5.0,
        mixed_version_fraction=0.0,
        seconds=1.5,
    )
    assert result.delay_steps is None
    result.collected_at_step = 7
    assert result.delay_steps == 3
    metrics = result.as_metrics()
    assert metrics["eval/step"] == 4 and metrics["eval/weight_version"] == 5
    assert metrics["eval/delay_steps"] == 3 and metrics["eval/skipped"] == 0
    assert metrics["eval/score"] == 0.75 and metrics["eval/mean_weight_version"] == 5.0
    assert metrics["eval/mixed_version_fraction"] == 0.0

    EvalLog(str(tmp_path / "eval.jsonl")).write(result)
    [row] = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert row["step"] == 4 and row["weight_version"] == 5 and row["delay_steps"] == 3
    assert row["mode"] == "dedicated" and row["status"] == "ok" and row["reason"] is None


def test_skipped_result_reports_no_score_and_stays_valid_json(tmp_path) -> None:
    result = EvalResult(
        step=1,
        weight_version=2,
        mode="shared",
        status="skipped",
        reason=VERSION_MISMATCH,
        message="engine reports 1",
        metrics={"score": math.nan},
        mean_weight_version=1.5,
        mixed_version_fraction=0.5,
        collected_at_step=1,
    )
    metrics = result.as_metrics()
    assert metrics["eval/skipped"] == 1.0 and "eval/score" not in metrics
    assert metrics["eval/mean_weight_version"] == 1.5 and metrics["eval/mixed_version_fraction"] == 0.5
    EvalLog(str(tmp_path / "eval.jsonl")).write(result)
    row = json.loads((tmp_path / "eval.jsonl").read_text())
    assert row["metrics"] == {"score": None} and row["reason"] == VERSION_MISMATCH


def test_backend_metrics_are_validated() -> None:
    metrics, versions = backend_metrics(
        {"score": 1, "mean_weight_version": 3, "mixed_version_fraction": 0}, "b"
    )
    assert metrics == {"score": 1.0}
    assert versions is not None and versions.mean_weight_version == 3.0
    metrics, versions = backend_metrics({"score": 0.5}, "b")
    assert versions is None
    for bad in ([0.5], {"score": "high"}, {"score": None}):
        with pytest.raises(EvalSkipped) as err:
            backend_metrics(bad, "b")
        assert err.value.reason == BACKEND_ERROR


def test_skip_reasons_are_a_closed_set() -> None:
    with pytest.raises(ValueError, match="unknown skip reason"):
        EvalSkipped("flaky", "no such reason")
