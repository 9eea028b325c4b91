"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE checkpoints made locally (no hub) for the Megatron tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

SHAPE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)


def make_checkpoint(family: str, directory: Path, seed: int = 0, **extra: Any) -> Path:
    """Save a randomly initialised HF model of ``family`` into ``directory`` (safetensors)."""
    import transformers

    torch.manual_seed(seed)
    shape = dict(SHAPE, **extra)
    if family == "qwen2":
        shape.pop("head_dim")
        model: Any = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    elif family == "qwen3_moe":
        moe = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**dict(moe, **shape)))
    else:
        raise ValueError(family)
    with torch.no_grad():  # norms start at 1.0: make them random too so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def make_batch(n: int = 5, seed: int = 0, step: int = 0, vocab: int = 96, positive: bool = False):
    """A random train batch over ``vocab`` tokens: prompts of 2-6 tokens, responses of 1-7, one masked token."""
    import random

    from miles.types import Prompt, Sample, TrainBatch

    rng = random.Random(seed)
    samples, advantages = [], []
    for i in range(n):
        p, r = rng.randint(2, 6), rng.randint(1, 7)
        mask = [1] * r
        if r > 2:
            mask[rng.randrange(r)] = 0
        samples.append(
            Sample(
                prompt=Prompt(index=i, prompt=f"p{i}"),
                prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                response_ids=[rng.randrange(vocab) for _ in range(r)],
                rollout_logprobs=[-(i * 100 + j + 1) / 1000.0 for j in range(r)],
                loss_mask=mask,
                weight_versions=[0] * r,
            )
        )
        advantages.append([1.0 if positive else rng.choice([-1.0, 0.5, 1.0])] * r)
    return TrainBatch(samples=samples, advantages=advantages, step=step)


# A reward that spreads every group's samples (a hash of the response in [0, 1)), so a random-weight
# model has a gradient at every step (an exact-match reward gives it none) and returns differ.
SPREAD_REWARD = """
import hashlib


def score(sample):
    return int.from_bytes(hashlib.sha256(sample.response_text.encode()).digest()[:4], "big") / 2**32
"""


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``."""
    import json

    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def cpu_run_config(tmp_path: Path, monkeypatch: Any, steps: int, *overrides: str) -> Any:
    """The default recipe, small, with the spread reward and ``backend: megatron`` on CPU (float32), writing
    into ``tmp_path``; ``overrides`` come last. The reward's module is put on ``sys.path`` for the run."""
    from miles.config import load_recipe

    modules = tmp_path / "modules"
    if not (modules / "megatron_spread_reward.py").is_file():
        modules.mkdir(exist_ok=True)
        (modules / "megatron_spread_reward.py").write_text(SPREAD_REWARD)
        monkeypatch.syspath_prepend(str(modules))
    base = [
        f"run.output_dir={tmp_path}",
        f"run.num_steps={steps}",
        "run.save_every=2",
        "warm_start=null",
        "eval=null",
        "tracking.console=false",
        "rollout.filters=[]",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.reward=megatron_spread_reward:score",
        "backend=megatron",
        'megatron={"device": "cpu", "params_dtype": "float32"}',
    ]
    return load_recipe("default", [*base, *overrides])


def cuda_run(tmp_path: Path, *overrides: str) -> tuple[list[dict[str, Any]], str]:
    """``miles run`` (a subprocess) of the default recipe, small, with ``backend: megatron`` on one GPU and the
    engine there too; ``overrides`` come last. Returns the metrics rows and the run directory."""
    import os
    import subprocess
    import sys

    sets = [
        "backend=megatron",
        "megatron.params_dtype=float32",
        "transport=colocated",
        "engine.device=cuda",
        "warm_start=null",
        "eval=null",
        "run.num_steps=3",
        "run.save_every=3",
        f"run.output_dir={tmp_path}/runs",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.filters=[]",
        "rollout.reward=numeric_closeness",
        "train.micro_batch_size=16",
        "tracking.console=false",
        "weight_sync.check_equal=true",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "miles", "run"] + [a for s in sets for a in ("--set", s)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    text = out.stdout[-4000:] + out.stderr[-8000:]
    assert out.returncode == 0, text
    runs = [dp for dp, _, files in os.walk(tmp_path / "runs") if "metrics.jsonl" in files]
    assert len(runs) == 1, text
    return read_rows(os.path.join(runs[0], "metrics.jsonl")), runs[0]
