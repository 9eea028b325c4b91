"""``miles run`` with ``backend: megatron`` (``megatron.device: cpu``) and a ``lora`` section: the trainer
trains an adapter, every weight update carries only the adapter's tensors (the weight-equality check
compares them on the engine), the engine serves it (its log-probs equal the trainer's), the run's
export is a peft adapter directory, and ``--resume`` continues the adapter.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# A reward that spreads every group's samples, so a random-weight model has a gradient at every step.
SPREAD_REWARD = """
import hashlib


def score(sample):
    return int.from_bytes(hashlib.sha256(sample.response_text.encode()).digest()[:4], "big") / 2**32
"""


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_miles_run_trains_a_lora_adapter_with_megatron_on_cpu(tmp_path, monkeypatch):
    from miles.config import load_recipe
    from miles.loop import train

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "megatron_lora_spread_reward.py").write_text(SPREAD_REWARD)
    monkeypatch.syspath_prepend(str(modules))

    def config(steps: int):
        overrides = [
            f"run.output_dir={tmp_path}",
            f"run.num_steps={steps}",
            "run.save_every=2",
            "warm_start=null",
            "eval=null",
            "tracking.console=false",
            "weight_sync.check_equal=true",
            "rollout.filters=[]",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.reward=megatron_lora_spread_reward:score",
            "train.lr=0.01",
            "backend=megatron",
            'megatron={"device": "cpu", "params_dtype": "float32"}',
            "lora.rank=8",
            "lora.alpha=16",
            f"lora.target_modules={json.dumps(TARGETS)}",
        ]
        return load_recipe("default", overrides)

    result = train(config(3))
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    adapter = load_file(f"{result.run_dir}/final/adapter_model.safetensors")
    # A and B of every target in every layer, under peft's names.
    assert {name.split(".")[-3] for name in adapter} == set(TARGETS)
    assert len(adapter) % (2 * len(TARGETS)) == 0
    # Only the adapter travelled, every update; the weight check compared each of its tensors once.
    assert {r["weight_sync/bytes"] for r in rows} == {sum(t.numel() * 4 for t in adapter.values())}
    assert rows[0]["weight_sync/checked_tensors"] == len(adapter)
    # The engine generated with the trained adapter: its log-probs equal the trainer's at every step.
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert max(r["correction/abs_dev"] for r in rows) < 1e-4
    assert [r["engine/weight_version"] for r in rows] == [1, 2, 3]
    assert all(float(t.norm()) > 0 for name, t in adapter.items() if "lora_B" in name)
    checkpoint = load_file(
        f"{result.run_dir}/checkpoints/step_000002/trainer/cpu/rank00000/model.safetensors"
    )
    assert checkpoint and all(".lora_" in name for name in checkpoint)

    result = train(config(4), resume=True)
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows][-2:] == [2, 3]  # from the step-2 checkpoint
    assert rows[-1]["correction/abs_dev"] < 1e-4
