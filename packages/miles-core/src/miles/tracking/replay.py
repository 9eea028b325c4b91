"""What the debugging commands do with a rollout dump (``miles replay ...``), as plain functions.

- :func:`rescore`: the dump's samples scored again with another (or the same) reward.
- :func:`recompute_logprobs` and :func:`compare_logprobs`: the trainer's view of a dumped step
  (an HF model's log-probs of the same tokens, at the rollout's temperature) against the
  engine's, per sample: where they first diverge, the largest difference and where it is.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.tracking.dumps import dump_files, read_dump, sample_from_record


def load_records(path: str, step: int | None = None) -> list[dict[str, Any]]:
    """The dump's records: a file, or a run directory / ``rollouts/`` (all steps, or ``step``)."""
    files = dump_files(path)
    rows = [row for file in files for row in read_dump(file)]
    if step is not None:
        rows = [row for row in rows if row.get("step") == step]
        if not rows:
            raise ValueError(f"the dump at {path} has no samples of step {step}")
    return rows


def run_dir_of(path: str) -> str | None:
    """The run directory a dump path lies in (the folder holding ``config.yaml``), if any."""
    here = os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path))
    for _ in range(3):
        if os.path.isfile(os.path.join(here, "config.yaml")):
            return here
        here = os.path.dirname(here)
    return None


# ------------------------------------------------------------------ rewards


@dataclass(frozen=True)
class Rescored:
    old: list[float | None]
    new: list[float]

    @property
    def changed(self) -> int:
        return sum(1 for a, b in zip(self.old, self.new, strict=True) if a is None or not math.isclose(a, b))


def rescore(
    records: Sequence[dict[str, Any]], reward: str, options: dict[str, Any] | None = None
) -> Rescored:
    """Score each dumped sample with ``reward`` (a name or import path), as the rollout would:
    a group reward gets each prompt's samples of a step together."""
    from miles.builtins.rollout.default import is_group_reward
    from miles.plugins import make_component

    fn = make_component("reward", reward, options or {})
    samples = [sample_from_record(r) for r in records]
    new: list[float] = [0.0] * len(samples)
    if is_group_reward(fn):
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(records):
            groups.setdefault((r["step"], r["prompt_index"]), []).append(i)
        for members in groups.values():
            values = _resolve(fn([samples[i] for i in members]))
            for i, v in zip(members, values, strict=True):
                new[i] = float(v)
    else:
        for i, sample in enumerate(samples):
            new[i] = float(_resolve(fn(sample)))
    return Rescored([r.get("reward") for r in records], new)


def _resolve(value: Any) -> Any:
    return asyncio.run(_await(value)) if inspect.isawaitable(value) else value


async def _await(value: Any) -> Any:
    return await value


# ------------------------------------------------------------------ log-prob mismatch


def recompute_logprobs(
    model_dir: str, records: Sequence[dict[str, Any]], temperature: float = 1.0
) -> list[list[float]]:
    """Each sample's response-token log-probs under the HF model at ``model_dir``, computed the way
    the trainer does (one forward over prompt + response, logits / temperature, log-softmax)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the command prints a table; a loading bar would tear it

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out: list[list[float]] = []
    with torch.no_grad():
        for r in records:
            prompt, response = list(r["prompt_ids"]), list(r["response_ids"])
            if not response:
                out.append([])
                continue
            ids = torch.tensor([prompt + response])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            if temperature != 1.0:
                logits = logits / temperature
            logp = torch.log_softmax(logits, dim=-1)
            out.append(logp.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1).tolist())
    return out


@dataclass(frozen=True)
class SampleMismatch:
    """One sample's train vs rollout log-probs, over its trained (loss-mask) tokens."""

    prompt_index: int
    group_index: int
    tokens: int
    first_divergence: int | None  # first response position with |diff| > tolerance
    max_abs_diff: float
    max_position: int | None
    mean_abs_diff: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def compare_logprobs(
    records: Sequence[dict[str, Any]], train: Sequence[Sequence[float]], tolerance: float = 1e-3
) -> list[SampleMismatch]:
    out = []
    for r, mine in zip(records, train, strict=True):
        rollout = list(r.get("rollout_logprobs") or [])
        mask = list(r.get("loss_mask") or [1] * len(rollout))
        diffs = [
            (pos, abs(a - b))
            for pos, (a, b, m) in enumerate(zip(mine, rollout, mask, strict=False))
            if m and a is not None and b is not None
        ]
        first = next((pos for pos, d in diffs if d > tolerance), None)
        worst = max(diffs, key=lambda pd: pd[1], default=None)
        out.append(
            SampleMismatch(
                prompt_index=r["prompt_index"],
                group_index=r.get("group_index", 0),
                tokens=len(diffs),
                first_divergence=first,
                max_abs_diff=worst[1] if worst else 0.0,
                max_position=worst[0] if worst else None,
                mean_abs_diff=sum(d for _, d in diffs) / len(diffs) if diffs else 0.0,
            )
        )
    return out


def mismatch_summary(rows: Sequence[SampleMismatch]) -> dict[str, Any]:
    diverged = [r for r in rows if r.first_divergence is not None]
    return {
        "samples": len(rows),
        "diverged": len(diverged),
        "max_abs_diff": max((r.max_abs_diff for r in rows), default=0.0),
        "mean_abs_diff": sum(r.mean_abs_diff * r.tokens for r in rows) / max(sum(r.tokens for r in rows), 1),
    }


def write_jsonl(path: str, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
