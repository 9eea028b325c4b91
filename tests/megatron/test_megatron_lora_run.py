"""``miles run`` with ``backend: megatron`` (``megatron.device: cpu``) and a ``lora`` section: the trainer
trains an adapter, every weight update carries only the adapter's tensors (the weight-equality check
compares them on the engine), the engine serves it (its log-probs equal the trainer's), the run's
export is a peft adapter directory, and ``--resume`` continues the adapter.
"""

from __future__ import annotations

import json

import pytest
from megatron_helpers import cpu_run_config, read_rows
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_miles_run_trains_a_lora_adapter_with_megatron_on_cpu(tmp_path, monkeypatch):
    from miles.loop import train

    def config(steps: int):
        lora = ["lora.rank=8", "lora.alpha=16", f"lora.target_modules={json.dumps(TARGETS)}"]
        return cpu_run_config(
            tmp_path, monkeypatch, steps, "weight_sync.check_equal=true", "train.lr=0.01", *lora
        )

    result = train(config(3))
    rows = read_rows(result.metrics_path)
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
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows][-2:] == [2, 3]  # from the step-2 checkpoint
    assert rows[-1]["correction/abs_dev"] < 1e-4
