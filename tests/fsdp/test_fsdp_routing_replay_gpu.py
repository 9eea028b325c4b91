"""Routing replay (R3) with the FSDP backend on one CUDA GPU (scripts/gpu-tests.sh; skipped without CUDA).

``miles run`` on the tiny Qwen3-MoE in bfloat16: the embedded engine on CUDA (its paged path with the
MoE fast path) records every token's routing, the FSDP trainer on the same GPU (colocated) measures
how often its own routers disagree (``train/routing_mismatch``), without replay and with it. On the
CPU both sides compute in float32 with the same kernels and agree everywhere; here the engine's
kernels are not the trainer's, which is what replay is for. The numbers are printed for docs/gpu.md.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from miles.routing import ROUTING_MISMATCH

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(tmp_path, name: str, *overrides: str) -> list[dict]:
    from miles.config import load_recipe
    from miles.loop import train

    config = load_recipe(
        "default",
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.num_steps=3",
            "warm_start=null",
            "eval=null",
            "model.path=builtin:tiny-qwen3-moe",
            "model.dtype=bfloat16",
            "engine.device=cuda",
            "fsdp.device=cuda",
            "fsdp.param_dtype=bfloat16",
            "transport=colocated",
            "rollout.prompts_per_step=8",
            "rollout.n_samples_per_prompt=4",
            "rollout.filters=[]",
            "rollout.reward=numeric_closeness",
            "tracking.console=false",
            *overrides,
        ],
    )
    result = train(config)
    with open(result.metrics_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_the_mismatch_is_measured_without_replay_and_replay_runs_on_cuda(tmp_path) -> None:
    recorded = _run(tmp_path, "record", "rollout.record_routed_experts=true")
    replayed = _run(tmp_path, "replay", "train.use_rollout_routing_replay=true")
    print("routing mismatch, recorded only:", [r[ROUTING_MISMATCH] for r in recorded])
    print("routing mismatch, replayed:", [r[ROUTING_MISMATCH] for r in replayed])
    print("TIS ratio abs dev, recorded only:", [r.get("correction/abs_dev") for r in recorded])
    print("TIS ratio abs dev, replayed:", [r.get("correction/abs_dev") for r in replayed])
    for rows in (recorded, replayed):
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert all(0.0 <= r[ROUTING_MISMATCH] <= 1.0 and math.isfinite(r["train/loss"]) for r in rows)
