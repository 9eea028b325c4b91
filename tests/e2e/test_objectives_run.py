"""Objectives end to end on the tiny model: PPO with its critic, a KL penalty, SFT, and distillation."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from miles.config import load_recipe
from miles.loop import train

pytestmark = pytest.mark.slow


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> str:
    """The SFT recipe, shortened: its final policy is the teacher of the distillation runs below."""
    out = tmp_path_factory.mktemp("sft")
    config = load_recipe(
        "sft-arith",
        [f"run.output_dir={out}", "run.num_steps=12", "run.save_every=null", "tracking.console=false"],
    )
    result = train(config)
    rows = _rows(result.metrics_path)
    # SFT loss falls; the data position moves on every step.
    assert len(rows) == 12 and rows[-1]["train/loss"] < 0.6 * rows[0]["train/loss"]
    assert all(r["sft/conversations"] == 32 for r in rows)
    assert not os.path.exists(os.path.join(result.run_dir, "engines"))  # no engine was started
    assert result.final_dir is not None
    return result.final_dir


def test_sft_run_trains_assistant_tokens_without_engines(sft_model) -> None:
    assert Path(sft_model, "model.safetensors").is_file()


def test_ppo_trains_a_critic_and_resumes_it(small_run, sft_model) -> None:
    # From the SFT policy, which answers with digits: rewards (and so returns) are not all zero.
    # A critic learns from every group, equal rewards included: no nonzero_std filter.
    overrides = [
        f"model.path={sft_model}",
        "algorithm.advantage=ppo",
        "algorithm.critic={lr: 0.01}",
        "run.save_every=1",
        "rollout.filters=[]",
    ]
    first = train(small_run(*overrides, "run.num_steps=2"))
    rows = _rows(first.metrics_path)
    assert all(math.isfinite(r["critic/value_loss"]) for r in rows)
    assert rows[0]["critic/values_mean"] == 0.0 and rows[0]["critic/returns_mean"] > 0  # the head starts at 0
    assert rows[1]["critic/values_mean"] != 0.0  # ... and has trained since
    resumed = train(small_run(*overrides, "run.num_steps=3"), resume=True)
    rows = _rows(resumed.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and math.isfinite(rows[2]["critic/value_loss"])


def test_kl_loss_against_the_reference_policy(small_run) -> None:
    result = train(
        small_run("algorithm.loss_options={kl_coef: 0.1, entropy_coef: 0.01}", "rollout.filters=[]")
    )
    rows = _rows(result.metrics_path)
    # Step 0 trains from the reference weights themselves: the KL starts at zero, then departs from it.
    assert rows[0]["loss/kl_loss"] == pytest.approx(0.0, abs=1e-9)
    assert rows[-1]["loss/kl_loss"] > 0
    assert all(math.isfinite(r["loss/entropy"]) for r in rows)


def test_distillation_from_an_in_process_teacher(small_run, sft_model) -> None:
    result = train(
        small_run(
            f"distillation={{teacher: trainer, model: {sft_model}, task_reward: zero}}",
            "rollout.filters=[]",
        )
    )
    rows = _rows(result.metrics_path)
    # The untrained student is far from the SFT teacher: a clearly positive reverse-KL estimate.
    assert all(r["distill/reverse_kl"] > 0.5 for r in rows)
    assert all(math.isfinite(r["distill/teacher_logprob_mean"]) for r in rows)


@pytest.mark.parametrize("top_k", [0, pytest.param(3, marks=pytest.mark.extended)])
def test_distillation_from_a_served_teacher(small_run, sft_model, top_k) -> None:
    """The run launches the teacher's engine itself, checks its tokenizer, and scores every trajectory."""
    result = train(
        small_run(
            f"distillation={{teachers: {{default: {{model: {sft_model}}}}}, top_k: {top_k}}}",
            "rollout.filters=[]",
            "run.num_steps=2",
        )
    )
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["distill/reverse_kl"] > 0.5 and math.isfinite(r["train/loss"]) for r in rows)
    assert os.listdir(os.path.join(result.run_dir, "teachers"))  # the teacher engine's log
