"""Fully asynchronous runs end to end: real engine process, real FSDP rank, local processes."""

from __future__ import annotations

import json

import pytest

from miles import hookimpl
from miles.loop import train
from miles.plugins import get_plugin_manager

pytestmark = pytest.mark.slow

BUFFER_METRICS = [
    "queue_size",
    "avg_staleness",
    "max_staleness",
    "buffer_avg_staleness",
    "buffer_max_staleness",
    "aborted_groups_filtered",
    "stale_groups_filtered",
]


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class _Trained:
    """What each step trained on: the weight versions of every token, and the evaluations."""

    def __init__(self) -> None:
        self.versions: dict[int, list[list[int]]] = {}
        self.statuses: set[str] = set()
        self.evals: list[tuple[int, dict]] = []

    @hookimpl
    def miles_advantages_postprocess(self, batch):
        self.versions[batch.step] = [list(s.weight_versions) for s in batch.samples]
        self.statuses.update(s.status.value for s in batch.samples)

    @hookimpl
    def miles_on_eval(self, step, metrics):
        self.evals.append((step, dict(metrics)))


def _run(config):
    rec = _Trained()
    pm = get_plugin_manager()
    pm.register(rec)
    try:
        return train(config), rec
    finally:
        pm.unregister(rec)


def test_fully_async_run_trains_within_the_staleness_limit_and_evaluates(small_run, tmp_path):
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text(
        "".join(json.dumps({"prompt": f"What is {a} + {a}?", "label": str(2 * a)}) + "\n" for a in range(4))
    )
    config = small_run(
        "run.num_steps=5",
        "schedule=fully_async",
        "fully_async.max_staleness=1",
        f"eval={{data: {{path: {eval_data}}}, every: 2}}",
    )
    result, rec = _run(config)
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows:
        for name in BUFFER_METRICS:
            assert f"rollout/fully_async/{name}" in row, (row["step"], name)
        assert row["rollout/fully_async/max_staleness"] <= 1
    # Every trained token is at most max_staleness versions older than the trainer's weights.
    for step, versions in rec.versions.items():
        oldest = min(v for sample in versions for v in sample)
        assert step - oldest <= 1, (step, oldest)
    # Generation ran ahead of training: some step trained on groups from an older version.
    assert any(min(v for s in versions for v in s) < step for step, versions in rec.versions.items())
    assert rec.statuses <= {"completed", "truncated"}
    # Evaluations of steps 1, 3 and the last (4), each checked against the version it measured.
    assert [step for step, _ in rec.evals] == [1, 3, 4]
    for step, metrics in rec.evals:
        assert metrics["eval/skipped"] == 0.0, metrics
        assert metrics["eval/mean_weight_version"] == step + 1
        assert metrics["eval/mixed_version_fraction"] == 0.0
        assert metrics["eval/delay_steps"] >= 0
    assert len(_rows(f"{result.run_dir}/eval.jsonl")) == 3


@pytest.mark.extended
def test_abort_update_mode_drops_the_interrupted_groups(small_run):
    config = small_run(
        "run.num_steps=4",
        "schedule=fully_async",
        "fully_async.update_mode=abort",
        "fully_async.aborted=discard",
        # A buffer that never fills keeps the worker generating, so every weight update finds
        # requests in flight to abort (with the default capacity a slow trainer lets the buffer
        # fill, generation idles, and an update may find nothing to interrupt).
        "fully_async.buffer_capacity=50",
        "fully_async.max_staleness=null",
        "rollout.max_new_tokens=48",
    )
    result, rec = _run(config)
    rows = _rows(result.metrics_path)
    assert sum(r["rollout/fully_async/aborted_groups_filtered"] for r in rows) >= 1
    assert "aborted" not in rec.statuses  # dropped on arrival, never trained on
