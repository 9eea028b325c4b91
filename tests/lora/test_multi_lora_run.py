"""Multi-LoRA GRPO end to end: two adapters, each with its own shape, rate, prompts and steps, one batch.

The engine serves each adapter's rollouts with that adapter (its log-probs of its own samples equal
the trainer's, adapter by adapter, while both adapters train); an update after which one adapter no
longer trains carries only the other's bytes; per-adapter metrics are logged; each export loads with
peft. (Resuming both adapters is tested on the trainer, ``test_multi_lora.py``: a run here takes
minutes on a loaded 2-core machine.)
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "v_proj", "down_proj", "lm_head"]
ADAPTERS = {
    "math": {"rank": 8, "alpha": 16, "target_modules": TARGETS},
    "code": {
        "rank": 4,
        "alpha": 8,
        "target_modules": TARGETS,
        "lr": 0.02,
        "num_steps": 2,
        "prompts_per_step": 2,
    },
}


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# A reward that spreads every group's samples (a hash of the response in [0, 1)), so each adapter
# has a gradient at every step. numeric_closeness scores a random-weight model's response 0 unless it
# holds a number by chance, and then a whole run could see no gradient, on one CPU and not another.
SPREAD_REWARD = """
import hashlib


def score(sample):
    digest = hashlib.sha256(sample.response_text.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32
"""


@pytest.fixture(autouse=True)
def _spread_reward(tmp_path, monkeypatch):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "multi_lora_spread_reward.py").write_text(SPREAD_REWARD)
    monkeypatch.syspath_prepend(str(modules))


def _config(tmp_path, steps: int, *extra: str):
    from miles.config import load_recipe

    overrides = [
        f"run.output_dir={tmp_path}",
        "run.name=multi",
        f"run.num_steps={steps}",
        "rollout.reward=multi_lora_spread_reward:score",
        "tracking.console=false",
        "rollout.filters=[]",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "train.lr=0.01",
        f"lora={json.dumps({'adapters': ADAPTERS})}",
        "warm_start=null",
        "eval=null",
        *extra,
    ]
    return load_recipe("default", overrides)


def _bytes(directory) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * 4 for t in load_file(f"{directory}/adapter_model.safetensors").values())


def test_two_adapters_train_in_one_run(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles.loop import train

    result = train(_config(tmp_path, 3))
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    final = f"{result.run_dir}/final"
    both, math = _bytes(f"{final}/math") + _bytes(f"{final}/code"), _bytes(f"{final}/math")
    # code trains steps 0 and 1 and then stays: the last update carries only math's tensors.
    assert [r["lora/code/stepped"] for r in rows] == [1.0, 1.0, 0.0]
    assert [r["lora/math/stepped"] for r in rows] == [1.0] * 3
    assert [r["weight_sync/bytes"] for r in rows] == [both, both, math]
    for r in rows:
        assert r["lora/math/rollout/samples"] == 16.0
        assert "lora/math/train/loss" in r and "lora/math/rollout/reward_mean" in r
        assert r["lora/math/train/lr"] == pytest.approx(0.01)
    for r in rows[:2]:
        assert r["lora/code/rollout/samples"] == 8.0 and r["lora/code/train/lr"] == pytest.approx(0.02)
    assert "lora/code/rollout/samples" not in rows[2]
    # Each adapter's rollouts were generated with that adapter as trained so far (B moved from 0,
    # so a base-serving engine, or one serving the other adapter, would differ from the trainer).
    for r in rows:
        assert r["lora/math/correction/abs_dev"] < 1e-4
    for r in rows[:2]:
        assert r["lora/code/correction/abs_dev"] < 1e-4
    # ... and those checks saw adapters that had trained (each had a gradient at every step).
    assert all(r["lora/math/train/grad_norm"] > 0 for r in rows)
    assert all(r["lora/code/train/grad_norm"] > 0 for r in rows[:2])
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


@pytest.mark.extended
def test_two_adapters_on_the_paged_engine_path(tmp_path):
    """Two steps of the same run with the engine on its paged KV path: both adapters sit in slots of
    one engine, each adapter's rollouts are served by it as trained so far (log-probs equal the
    trainer's), and each update carries both adapters' bytes."""
    from miles.loop import train

    paged = (
        "engine.options.kv_cache=paged",
        "engine.options.kv_tokens=4096",
        "engine.options.max_lora_rank=8",
    )
    result = train(_config(tmp_path, 2, *paged))
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1]
    final = f"{result.run_dir}/final"
    assert [r["weight_sync/bytes"] for r in rows] == [_bytes(f"{final}/math") + _bytes(f"{final}/code")] * 2
    for r in rows:
        for name in ("math", "code"):
            assert r[f"lora/{name}/correction/abs_dev"] < 1e-4
    # Step 1's rollouts ran on adapters trained at step 0 (both had a gradient), so the check saw them.
    assert all(rows[0][f"lora/{n}/train/grad_norm"] > 0 for n in ("math", "code"))
