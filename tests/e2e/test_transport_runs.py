"""The loop with each weight transport: the FSDP trainer feeds the engines by disk-delta, checked."""

from __future__ import annotations

import json
import os

import pytest
from transports.p2p_support import needs_mooncake

from miles.loop import train

pytestmark = pytest.mark.slow


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_disk_delta_run_with_the_fsdp_backend(small_run) -> None:
    # An entropy bonus gives every step a gradient even when all rewards tie (GRPO's advantages are then 0).
    result = train(
        small_run("transport=disk-delta", "rollout.filters=[]", "algorithm.loss_options={entropy_coef: 0.01}")
    )
    rows = _rows(result.metrics_path)
    assert [r["engine/weight_version"] for r in rows] == [1.0, 2.0, 3.0]
    for row in rows:
        # A learning rate of 0.01 on a tiny float32 model changes most bytes; what matters is that the
        # update is a delta, published and applied, and the density is reported.
        assert 0 < row["weight_sync/delta_density"] <= 1
        assert row["weight_sync/bytes"] > 0
    versions = sorted(os.listdir(os.path.join(result.run_dir, "weight_deltas")))
    assert versions[-1] == "v000003" and len(versions) <= 3  # older versions are pruned


@needs_mooncake
def test_p2p_run_with_the_fsdp_backend(small_run) -> None:
    result = train(
        small_run("transport=p2p", "engine.num_engines=2", "weight_sync.options={bucket_mb: 0.25}")
    )
    rows = _rows(result.metrics_path)
    assert [r["engine/weight_version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["weight_sync/buckets"] > 1 and r["weight_sync/bytes"] > 0 for r in rows)
