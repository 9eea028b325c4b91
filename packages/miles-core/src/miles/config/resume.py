"""What may change when a run resumes, and what must not.

A resumed run continues from a checkpoint: the trainer's weights and optimizer state, the
data source's position and the weight version. Settings those depend on (the model, the
dataset, the backend, the data order's seed, which models exist beside the policy) cannot
change without making the checkpoint describe a different run, so a resume that changes
one is refused with the key named. Everything else (learning rate, sampling, rewards,
engines, transports, schedules, logging, the number of steps) may change and takes effect
from the first resumed step; the driver logs each change and the run directory keeps the
recipe of every earlier start (``config_history/``).

Plugin sections are immutable unless the plugin lists the keys that may change in its
``ConfigSection.resume_mutable``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from miles.errors import ConfigError

# Dotted key prefixes of the core sections that may change across a resume.
MUTABLE = (
    "run.num_steps",
    "run.save_every",
    "run.keep_checkpoints",
    "run.export_hf",
    "rollout",
    "engine",
    "train",
    "algorithm.advantage",
    "algorithm.advantage_options",
    "algorithm.loss",
    "algorithm.loss_options",
    "algorithm.correction",
    "algorithm.correction_options",
    "algorithm.critic.lr",
    "algorithm.critic.loss",
    "algorithm.critic.loss_options",
    "transport",
    "weight_sync",
    "tracking",
    "eval",
    "schedule",
    "fully_async",
    "placement",
    "distillation.coef",
    "distillation.task_reward",
    "distillation.teachers",
    "distillation.route_key",
    "sft.batch_size",
    "sft.max_length",
    "evidence",  # what is known about the recipe, not how it trains
)
IGNORED = ("recipe",)  # where the config was loaded from, not what it says


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": leaf}``; lists and scalars are leaves; a missing section is None."""
    if isinstance(data, Mapping) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def changed_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (old, new)}`` for every leaf that differs (a key present on one side only included)."""
    a, b = flatten(old), flatten(new)
    out: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(a) | set(b)):
        if key.split(".")[0] in IGNORED:
            continue
        # A section that appears or disappears shows up as None against its leaves.
        va = a.get(key, _parent_value(a, key))
        vb = b.get(key, _parent_value(b, key))
        if va != vb:
            out[key] = (va, vb)
    return out


def _parent_value(flat: Mapping[str, Any], key: str) -> Any:
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:end])
        if parent in flat:
            return flat[parent]
    return None


def is_mutable(key: str, mutable: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in mutable)


def check_resume_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], plugin_mutable: Iterable[str] = ()
) -> dict[str, tuple[Any, Any]]:
    """The settings a resume changes; raises ``ConfigError`` naming every one that cannot change."""
    mutable = (*MUTABLE, *plugin_mutable)
    changes = changed_settings(old, new)
    refused = [key for key in changes if not is_mutable(key, mutable)]
    if refused:
        shown = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in refused)
        raise ConfigError(
            f"--resume cannot change {shown} (the checkpoint was trained with the earlier value). "
            "Resume with the earlier value, or start a new run (another run.name, or --overwrite)"
        )
    return changes
