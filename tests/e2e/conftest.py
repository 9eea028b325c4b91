"""Helpers for end-to-end runs of the real loop (real engine process, real FSDP rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config import load_recipe


@pytest.fixture
def small_run(tmp_path: Path):
    """A default-recipe config shrunk to a few steps, writing under tmp_path."""

    def make(*overrides: str):
        base = [
            f"run.output_dir={tmp_path}",
            "run.num_steps=3",
            # RL mechanics from the tiny model as it is: no supervised stage, no evaluation.
            "warm_start=null",
            "eval=null",
            # The RL settings these tests were written for (the default recipe's before its warm start).
            "rollout.reward=numeric_closeness",
            "train.lr=0.01",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "tracking.console=false",
            # The project's own runs check that every engine holds exactly the trainer's weights.
            "weight_sync.check_equal=true",
        ]
        return load_recipe("default", [*base, *overrides])

    return make
