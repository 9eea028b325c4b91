"""A real RL run on the embedded engine's paged path (CPU): launched through the recipe's engine.options,
weights updated every step, the KV cache released after every rollout and resumed before the next
(engine.release_memory, colocated), and the engine's log-probs equal to the trainer's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from miles.loop import train

pytestmark = pytest.mark.slow


def test_rl_run_on_the_paged_engine_path(small_run) -> None:
    # kv_cache: paged is refused (not silently replaced) when the path cannot run, so a run that
    # finishes ran on it.
    config = small_run(
        "engine.options.kv_cache=paged",
        "engine.options.kv_tokens=2048",
        "engine.options.chunk_tokens=64",
        "rollout.n_samples_per_prompt=8",
        "run.num_steps=2",
        "transport=colocated",
        "engine.release_memory=true",
    )
    result = train(config)
    with open(result.metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["engine/weight_version"] == r["step"] + 1
        # Released after every rollout; resumed (a real call) from the second rollout on.
        assert r["time/engine_release_s"] > 0
    assert rows[1]["time/engine_resume_s"] > 0
    # The trainer's log-probs of the engine's tokens, against the engine's own (TIS ratio), on every
    # step that trained (a step whose groups the nonzero_std filter all dropped has none).
    trained = [r for r in rows if "correction/ratio_mean" in r]
    assert trained, rows
    for r in trained:
        assert r["correction/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
        assert r["correction/abs_dev"] < 1e-3
    log_dir = os.path.join(result.run_dir, "engines")
    logs = "".join(Path(log_dir, n).read_text(encoding="utf-8") for n in os.listdir(log_dir))
    assert "DynamicCache path" not in logs


def test_paged_options_reach_the_engine_command(tmp_path) -> None:
    from miles.engines.launchers import EmbeddedLauncher, EngineSpec

    argv = EmbeddedLauncher().command(
        EngineSpec(
            model_path="m",
            options={"kv_cache": "paged", "kv_tokens": 4096, "block_size": 8, "cuda_graphs": False},
        ),
        9,
    )
    tail = argv[argv.index("--parent-pid") + 2 :]
    assert tail == ["--kv-cache", "paged", "--kv-tokens", "4096", "--block-size", "8", "--no-cuda-graphs"]
