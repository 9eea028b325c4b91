"""`miles run` end to end on terminal tasks: the tiny model on CPU, the session server, the
`terminal` agent in local sandboxes, fully asynchronous, with exit reasons in every step's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles import hookimpl
from miles.config import load_recipe
from miles.loop import train
from miles.plugins import get_plugin_manager
from miles.types import ExitReason
from miles_envs.terminal.task import builtin_tasks_dir

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "packages/miles-envs/src/miles_envs/recipes/terminal-tiny.yaml"


class _Metrics:
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.samples: list = []

    @hookimpl
    def miles_on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = dict(metrics)

    @hookimpl
    def miles_advantages_postprocess(self, batch) -> None:  # type: ignore[no-untyped-def]
        self.samples.extend(batch.samples)


def test_agentic_terminal_run_logs_exit_reasons_per_step(provider, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert builtin_tasks_dir().is_dir()
    config = load_recipe(
        str(RECIPE),
        [
            f"run.output_dir={tmp_path}",
            "run.num_steps=2",
            "rollout.prompts_per_step=2",
            "tracking.console=false",
            "data.options={tasks: [hello-file, count-lines, sort-csv]}",
        ],
    )
    assert config.schedule == "fully_async" and config.agentic.agent == "terminal"
    rec = _Metrics()
    pm = get_plugin_manager()
    pm.register(rec)
    try:
        train(config)
    finally:
        pm.unregister(rec)
    assert sorted(rec.steps) == [0, 1]
    known = {f"rollout/exit/{r.value}" for r in ExitReason}
    for metrics in rec.steps.values():
        exits = {k: v for k, v in metrics.items() if k.startswith("rollout/exit/")}
        assert exits and set(exits) <= known, metrics
        assert sum(exits.values()) == metrics["rollout/samples"]  # one exit reason per trained sample
        assert "rollout/episode/tool_time_s_total" in metrics
    for sample in rec.samples:
        assert sample.metadata["terminal_task"] in {"hello-file", "count-lines", "sort-csv"}
        assert sample.metadata["exit_reason"] in {r.value for r in ExitReason}
        assert sample.reward == 0.0 and sample.metadata["test_exit_code"] not in (
            0,
            None,
        )  # the random model solves nothing
