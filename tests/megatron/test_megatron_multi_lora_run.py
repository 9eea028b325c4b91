"""``miles run`` with ``backend: megatron`` (``megatron.device: cpu``) and ``lora.adapters``: two adapters
(their own shapes, rates, prompts per step and step counts) train in one run; the engine serves each
adapter's rollouts with that adapter as trained so far (its log-probs of each adapter's samples equal the
trainer's); once one adapter stops training an update carries only the other's bytes; per-adapter
metrics; each ``final/<name>/`` export is a peft directory, and both load side by side; ``--resume``
brings the engine both adapters as checkpointed.
"""

from __future__ import annotations

import json
import os

import pytest
from megatron_helpers import cpu_run_config, read_rows

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "math": {"rank": 8, "alpha": 16, "target_modules": TARGETS},
    "code": {
        "rank": 4,
        "alpha": 8,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "lr": 0.02,
        "num_steps": 2,
        "prompts_per_step": 2,
    },
}


def _bytes(directory: str) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * 4 for t in load_file(f"{directory}/adapter_model.safetensors").values())


def test_miles_run_trains_two_adapters_with_megatron_on_cpu(tmp_path, monkeypatch):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles.loop import train

    def config(steps: int):
        return cpu_run_config(
            tmp_path, monkeypatch, steps, "train.lr=0.01", f"lora={json.dumps({'adapters': ADAPTERS})}"
        )

    result = train(config(3))
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    final = f"{result.run_dir}/final"
    both, math = _bytes(f"{final}/math") + _bytes(f"{final}/code"), _bytes(f"{final}/math")
    # code trains steps 0 and 1 and then stays: the last update carries only math's tensors.
    assert [r["lora/code/stepped"] for r in rows] == [1.0, 1.0, 0.0]
    assert [r["lora/math/stepped"] for r in rows] == [1.0] * 3
    assert [r["weight_sync/bytes"] for r in rows] == [both, both, math]
    for r in rows:
        assert r["lora/math/rollout/samples"] == 16.0 and r["lora/math/train/lr"] == pytest.approx(0.01)
    for r in rows[:2]:
        assert r["lora/code/rollout/samples"] == 8.0 and r["lora/code/train/lr"] == pytest.approx(0.02)
    assert "lora/code/rollout/samples" not in rows[2]
    # Each adapter's rollouts were generated with that adapter as trained so far.
    for r in rows:
        assert r["lora/math/correction/abs_dev"] < 1e-4 and r["lora/math/train/grad_norm"] > 0
    for r in rows[:2]:
        assert r["lora/code/correction/abs_dev"] < 1e-4 and r["lora/code/train/grad_norm"] > 0
    for name in ("math", "code"):
        factors = load_file(f"{final}/{name}/adapter_model.safetensors")
        assert any(float(t.norm()) > 0 for k, t in factors.items() if "lora_B" in k), name
    # Both exports are peft adapter directories of the base, and load side by side.
    with open(f"{final}/math/adapter_config.json", encoding="utf-8") as f:
        base_path = json.load(f)["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, f"{final}/math", adapter_name="math")
    model.load_adapter(f"{final}/code", adapter_name="code")
    assert sorted(model.peft_config) == ["code", "math"]
    # The run's checkpoint holds both adapters' factors and optimizer states.
    trainer_dir = f"{result.run_dir}/checkpoints/step_000002/trainer/cpu/rank00000"
    assert sorted(f for f in os.listdir(trainer_dir) if f.startswith("optimizer")) == [
        "optimizer-code.pt",
        "optimizer-math.pt",
    ]

    # --resume from the step-2 checkpoint (written after step 2): the engine, started again with the initial
    # adapters, is brought both checkpointed adapters before it generates (an update outside the steps'
    # rows; with nothing to send it would fail), so step 3's rollouts of math are served by math as
    # trained (B away from zero: the initial adapter would differ); step 3's update carries math only.
    result = train(config(4), resume=True)
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["weight_sync/bytes"] == math and rows[-1]["lora/code/stepped"] == 0.0
    assert rows[-1]["lora/math/correction/abs_dev"] < 1e-4
