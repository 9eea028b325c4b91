"""A recipe that selects a third-party plugin's reward and loss by name trains with them."""

from __future__ import annotations

import json
import sys

import pytest

from miles import hookimpl
from miles.loop import train
from miles.plugins import get_plugin_manager

# fixture_plugins installs tests/plugins/miles-example-plugin, also for the engine and trainer processes.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fixture_plugins")]


class _Rewards:
    def __init__(self) -> None:
        self.samples = []

    @hookimpl
    def miles_rollout_postprocess(self, groups, step):
        self.samples.extend(s for g in groups for s in g.samples)


def test_run_selects_example_plugin_reward_loss_and_config_section(small_run, monkeypatch):
    import miles_example_plugin

    # The plugin keeps its configured target in a module global; restore it after this test.
    monkeypatch.setattr(miles_example_plugin, "target_length", miles_example_plugin.target_length)
    config = small_run(
        "run.num_steps=1",
        "run.export_hf=false",
        "rollout.reward=length_penalty",
        "algorithm.loss=reinforce",
        "rollout.max_new_tokens=6",
        "rollout.filters=[]",
        "example.target_length=2",  # the plugin's own typed config section
    )
    seen = _Rewards()
    pm = get_plugin_manager()
    pm.register(seen)
    try:
        result = train(config)
    finally:
        pm.unregister(seen)

    # The plugin's reward scored every sample: 1 - 0.1 * max(0, len - 2).
    assert seen.samples
    for s in seen.samples:
        assert s.reward == pytest.approx(max(0.0, 1.0 - 0.1 * max(0, len(s.response_ids) - 2)))
    # The plugin's loss ran in the trainer rank: only ReinforceLoss reports `logprob_mean`.
    with open(result.metrics_path, encoding="utf-8") as f:
        row = json.loads(f.readline())
    assert "loss/logprob_mean" in row
    assert "loss/clipfrac" not in row  # the built-in ppo_clip did not run
    assert "miles_broken_plugin.reward" not in sys.modules
