"""Routing replay (R3) end to end on CPU: ``miles run`` on the tiny Qwen3-MoE, the embedded engine
recording every token's routing (prompt and response), the FSDP trainer replaying it."""

from __future__ import annotations

import json

import pytest

from miles.loop import train
from miles.routing import ROUTING_MISMATCH

pytestmark = pytest.mark.slow


def test_a_run_replays_the_engines_routing_and_logs_the_mismatch(small_run) -> None:
    config = small_run(
        "model.path=builtin:tiny-qwen3-moe",
        "train.use_rollout_routing_replay=true",
        "run.num_steps=2",
        "rollout.filters=[]",  # every step trains, so every step measures
    )
    result = train(config)
    with open(result.metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["engine/weight_version"] for r in rows] == [1.0, 2.0]
    # The trainer saw every sample's routing (a sample without it is refused under replay) and its own
    # routers, on the CPU in float32 like the engine, agree with the engine's nearly everywhere.
    for r in rows:
        assert 0.0 <= r[ROUTING_MISMATCH] <= 0.05, r
