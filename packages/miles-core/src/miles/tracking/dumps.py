"""Rollout dumps: every step's samples as JSON lines, ``rollouts/step_NNNNNN.jsonl`` in the run directory.

On with ``rollout.dump: true``. One line per sample, written when the step's groups are scored
(after every ``miles_rollout_postprocess`` plugin, before filters and the buffer, so samples
the filters drop are in the dump too). Fields (docs/observability.md):

    step, prompt_index, group_index, label, prompt (text or chat messages), prompt_ids,
    response_ids, response_text, rollout_logprobs, loss_mask, weight_versions, reward,
    status, finish_reason, token_scores, metadata

JSON lines rather than Parquet: streamable while the run writes, readable without pyarrow,
and one step's file is small (a few thousand samples).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from miles import hookimpl
from miles.types import Group, Prompt, Sample, Status

DUMP_DIR = "rollouts"


def dump_path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, DUMP_DIR, f"step_{step:06d}.jsonl")


def sample_record(step: int, sample: Sample) -> dict[str, Any]:
    p = sample.prompt
    return {
        "step": step,
        "prompt_index": p.index,
        "group_index": sample.group_index,
        "label": p.label,
        "prompt": p.prompt,
        "prompt_ids": sample.prompt_ids,
        "response_ids": sample.response_ids,
        "response_text": sample.response_text,
        "rollout_logprobs": sample.rollout_logprobs,
        "loss_mask": sample.loss_mask,
        "weight_versions": sample.weight_versions,
        "reward": sample.reward,
        "status": str(sample.status),
        "finish_reason": sample.finish_reason,
        "token_scores": sample.token_scores,
        "metadata": sample.metadata,
    }


def sample_from_record(row: dict[str, Any]) -> Sample:
    """The sample a dump line describes (what a reward or a trainer needs of it)."""
    prompt = Prompt(index=row["prompt_index"], prompt=row["prompt"], label=row.get("label"))
    return Sample(
        prompt=prompt,
        group_index=row.get("group_index", 0),
        prompt_ids=list(row["prompt_ids"]),
        response_ids=list(row["response_ids"]),
        response_text=row.get("response_text", ""),
        rollout_logprobs=list(row.get("rollout_logprobs") or []),
        loss_mask=list(row.get("loss_mask") or []),
        weight_versions=list(row.get("weight_versions") or []),
        reward=row.get("reward"),
        token_scores={k: list(v) for k, v in (row.get("token_scores") or {}).items()},
        status=Status(row.get("status", "completed")),
        finish_reason=row.get("finish_reason"),
        metadata=dict(row.get("metadata") or {}),
    )


def read_dump(path: str) -> Iterator[dict[str, Any]]:
    """The records of a dump file, in order; a half-written last line (a running run) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return  # the writer is mid-line
            if line.strip():
                yield json.loads(line)


def dump_files(path: str) -> list[str]:
    """``path`` itself if it is a file, else the step files of a run directory or its ``rollouts/``."""
    if os.path.isfile(path):
        return [path]
    folder = path if os.path.basename(os.path.normpath(path)) == DUMP_DIR else os.path.join(path, DUMP_DIR)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no rollout dump at {path} (run with rollout.dump: true)")
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".jsonl"))


class RolloutDumper:
    """The hook plugin that writes the dumps. Runs last among the post-processors (``trylast``),
    so a dump shows the rewards as shaped."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        os.makedirs(os.path.join(run_dir, DUMP_DIR), exist_ok=True)
        # A step's first write in this process starts its file afresh (a resumed run redoes steps);
        # later rounds of the same step (dynamic sampling) append.
        self._started: set[int] = set()

    @hookimpl(trylast=True)
    def miles_rollout_postprocess(self, groups: list[Group], step: int) -> None:
        mode = "a" if step in self._started else "w"
        self._started.add(step)
        with open(dump_path(self.run_dir, step), mode, encoding="utf-8") as f:
            for group in groups:
                for sample in group.samples:
                    # default=str: a plugin's metadata may hold values JSON has no type for.
                    f.write(json.dumps(sample_record(step, sample), default=str) + "\n")

    def close(self) -> None:
        """Nothing held open: each step's file is closed once written."""
