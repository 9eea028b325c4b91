"""A LoRA run killed after a checkpoint resumes the same adapter, and its engine serves it at once."""

from __future__ import annotations

import json

import pytest

from miles import hookimpl

pytestmark = pytest.mark.slow


class _DiesAfter:
    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def miles_on_metrics(self, step, metrics):
        if step == self.step:
            raise KeyboardInterrupt("simulated kill")


def _config(tmp_path, *extra: str):
    from miles.config import load_recipe

    overrides = [
        f"run.output_dir={tmp_path}",
        "run.name=lora-resume",
        "run.num_steps=4",
        "run.save_every=2",
        "tracking.console=false",
        "rollout.filters=[]",
        "rollout.reward=numeric_closeness",
        "train.lr=0.01",
        "lora.rank=8",
        'lora.target_modules=["q_proj","v_proj","down_proj","lm_head"]',
        *extra,
    ]
    overrides += ["warm_start=null", "eval=null"]  # RL from the tiny model as it is, no evaluations
    return load_recipe("default", overrides)


def test_resume_continues_the_adapter_and_refuses_another_lora(tmp_path):
    from miles.errors import ConfigError
    from miles.loop import train
    from miles.plugins import get_plugin_manager

    pm = get_plugin_manager()
    killer = _DiesAfter(2)
    pm.register(killer)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(_config(tmp_path))
    finally:
        pm.unregister(killer)

    # The adapter's shape is part of the checkpoint: another rank is refused by name, before anything runs.
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        train(_config(tmp_path, "lora.rank=4"), resume=True)

    result = train(_config(tmp_path), resume=True)
    with open(result.metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # The resumed trainer holds the step-2 adapter and the engine (which started with the initial,
    # all-zero-B adapter) was brought to it before generating: their log-probs agree from step 2 on.
    assert all(r["correction/abs_dev"] < 1e-4 for r in rows[2:])
    assert max(abs(r["train/grad_norm"]) for r in rows) > 0
