"""The run directory: what a run writes, and the rules that keep everything else safe.

Layout::

    RUN_DIR/miles-run.json         the marker: this directory is a Miles run (status, steps, resumes)
    RUN_DIR/config.yaml            the resolved recipe that runs now
    RUN_DIR/config_history/        the recipe of every earlier start of this run (resumes)
    RUN_DIR/metrics.jsonl          one row per step
    RUN_DIR/trained_prompts.jsonl  the prompt indices each step trained on
    RUN_DIR/tensorboard/           event files
    RUN_DIR/engines/               engine logs
    RUN_DIR/checkpoints/step_N/    resumable: trainer/ (backend state) + state.json (loop state)
    RUN_DIR/checkpoints/latest     name of the newest complete checkpoint (written last)
    RUN_DIR/final/                 Hugging Face checkpoint of the final policy

The marker is what makes a directory deletable: ``--overwrite`` removes only what a Miles
run wrote into a directory that carries it (the entries the marker recorded and the
layout above), never a directory without it, never a symbolic link, and never anything
but a direct child of ``run.output_dir``. A run that failed before its first step holds
nothing worth keeping, so the next plain run replaces it without ``--overwrite``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

from miles.errors import RunDirError

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
MARKER = "miles-run.json"
TRAINED_PROMPTS = "trained_prompts.jsonl"
# The supervised stage an RL run may start with (miles.driver.warm_start): a run directory of its own.
WARM_START_DIR = "warm_start"
# What a run writes at the top of its directory (besides the entries a plugin adds, which the
# marker records as they appear).
LAYOUT = (
    MARKER,
    "config.yaml",
    "config_history",
    "metrics.jsonl",
    "time_breakdown.txt",
    "reward_curve.png",
    TRAINED_PROMPTS,
    "tensorboard",
    "engines",
    "checkpoints",
    "final",
    "eval.jsonl",
    "eval_snapshots",
    "eval_engines",
    "teachers",
    "weight_deltas",
    WARM_START_DIR,
)


@dataclass
class LoopState:
    """Everything besides the trainer's own state that a resumed run needs."""

    step: int = 0  # the next step to run
    weight_version: int = 0  # the version the engines must serve
    data_source: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunMarker:
    """The contents of ``miles-run.json``."""

    created: str
    status: str = "starting"  # starting | running | completed | interrupted | failed
    steps_done: int = 0
    entries: list[str] = field(default_factory=list)  # top-level entries this run wrote
    foreign: list[str] = field(default_factory=list)  # entries already there that the run did not write
    resumes: list[dict[str, Any]] = field(default_factory=list)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class RunDir:
    def __init__(self, path: str, output_dir: str | None = None) -> None:
        self.path = path
        # The parent the run directory must sit directly inside (None: its own parent).
        self.output_dir = output_dir if output_dir is not None else os.path.dirname(path) or "."

    def sub(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def checkpoints(self) -> str:
        return self.sub("checkpoints")

    # ------------------------------------------------------------- safety

    def check(self, *, resume: bool, overwrite: bool) -> None:
        """Refuse to clobber anything unless asked, and anything not ours even when asked; writes nothing."""
        if resume and overwrite:
            raise RunDirError("--resume and --overwrite contradict each other; pass one")
        self._check_location()
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise RunDirError(f"run directory {self.path} exists and is not a directory")
        existing = self._listing()
        marker = self.read_marker()
        if resume:
            if self.latest_checkpoint() is not None or self.in_warm_start():
                return
            if marker is not None and marker.steps_done == 0:
                raise RunDirError(
                    f"--resume: the run in {self.path} never finished a step, so there is nothing to "
                    "resume; run it again without --resume"
                )
            raise RunDirError(
                f"--resume: no complete checkpoint under {self.checkpoints}; a run saves one every "
                "run.save_every steps (unset: never). Start it afresh with --overwrite"
            )
        if not existing:
            return
        if marker is None:
            shown = ", ".join(existing[:4]) + (", ..." if len(existing) > 4 else "")
            raise RunDirError(
                f"{self.path} is not empty and is not a Miles run directory (it has no {MARKER}; it holds "
                f"{shown}). Miles writes runs only into new or empty directories and never deletes "
                "what it did not write: choose another run.name or run.output_dir"
            )
        if overwrite or self._replaceable(marker):
            return
        latest = self.latest_checkpoint()
        where = f"last checkpoint {os.path.basename(latest)}" if latest else "no checkpoint"
        raise RunDirError(
            f"run directory {self.path} holds a Miles run ({marker.status}, {marker.steps_done} steps done, "
            f"{where}); pass --resume to continue it, --overwrite to delete it and start afresh, "
            "or choose another run.name"
        )

    def prepare(self, *, resume: bool, overwrite: bool) -> None:
        """Check, then create the directory (replacing an earlier run with ``overwrite``) and mark it."""
        self.check(resume=resume, overwrite=overwrite)
        marker = self.read_marker()
        if not resume and marker is not None:
            if not overwrite:  # check() let it through: it failed before its first step
                log.warning("replacing the run in %s, which failed before its first step", self.path)
            kept = self._remove_run(marker)
        else:
            kept = [] if marker is not None else [n for n in self._listing() if n not in LAYOUT]
        os.makedirs(self.path, exist_ok=True)
        if resume and marker is not None:
            return
        # A resumed run from before markers existed gets one now; a new run starts with one.
        self.write_marker(RunMarker(created=_now(), foreign=kept))

    def _check_location(self) -> None:
        name = os.path.basename(self.path.rstrip(os.sep))
        if set(name) <= {"."}:  # "", ".", "..": output_dir itself or a parent of it
            raise RunDirError(f"run directory {self.path!r}: the run name must not be {name!r}")
        if os.path.islink(self.path):
            raise RunDirError(
                f"run directory {self.path} is a symbolic link (to {os.path.realpath(self.path)}); "
                "Miles writes runs only into real directories"
            )
        if os.path.dirname(os.path.realpath(self.path)) != os.path.realpath(self.output_dir):
            raise RunDirError(f"run directory {self.path} is not inside run.output_dir {self.output_dir}")

    def in_warm_start(self) -> bool:
        """The run stopped in its warm start (which wrote a run marker), before its first RL step."""
        if not os.path.isfile(self.sub(WARM_START_DIR, MARKER)) or self.latest_checkpoint() is not None:
            return False
        marker = self.read_marker()
        return marker is None or marker.steps_done == 0

    def _listing(self) -> list[str]:
        return sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []

    def _replaceable(self, marker: RunMarker) -> bool:
        """A run that never finished a step (its start-up failed): nothing in it is worth keeping."""
        return marker.steps_done == 0 and self.latest_checkpoint() is None and not self.in_warm_start()

    def _remove_run(self, marker: RunMarker) -> list[str]:
        """Delete what the earlier run wrote; keep (and name) anything else in the directory."""
        ours = (set(LAYOUT) | set(marker.entries)) - set(marker.foreign)
        kept = []
        for name in self._listing():
            if name not in ours:
                kept.append(name)
                continue
            path = self.sub(name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        if kept:
            log.warning("kept %d entries in %s that Miles did not write: %s", len(kept), self.path, kept)
        return kept

    # ------------------------------------------------------------- marker

    def read_marker(self) -> RunMarker | None:
        path = self.sub(MARKER)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            return RunMarker(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise RunDirError(
                f"{path} is not a readable run marker ({exc}); fix or remove it by hand"
            ) from exc

    def write_marker(self, marker: RunMarker) -> None:
        seen = set(marker.entries) | set(self._listing()) | {MARKER}
        marker.entries = sorted(seen - set(marker.foreign))
        _write_json_atomic(self.sub(MARKER), asdict(marker))

    def update_marker(self, **changes: Any) -> None:
        """Record progress (status, steps_done) and the entries the run has written so far."""
        marker = self.read_marker() or RunMarker(created=_now())
        for key, value in changes.items():
            setattr(marker, key, value)
        self.write_marker(marker)

    def record_resume(self, checkpoint: str, changed: dict[str, Any]) -> None:
        marker = self.read_marker() or RunMarker(created=_now())
        marker.resumes.append({"at": _now(), "checkpoint": os.path.basename(checkpoint), "changed": changed})
        self.write_marker(marker)

    def keep_config_history(self) -> None:
        """Before a resume rewrites config.yaml, keep the recipe the earlier start ran with."""
        current = self.sub("config.yaml")
        if not os.path.isfile(current):
            return
        history = self.sub("config_history")
        os.makedirs(history, exist_ok=True)
        n = len([f for f in os.listdir(history) if f.endswith(".yaml")])
        shutil.copyfile(current, os.path.join(history, f"config.{n:03d}.yaml"))

    def record_trained_prompts(self, step: int, prompt_indices: list[int]) -> None:
        """One row per step: the data-source indices of the groups that step trained on, in batch order."""
        with open(self.sub(TRAINED_PROMPTS), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "prompts": prompt_indices}) + "\n")

    # ------------------------------------------------------------ checkpoints

    def checkpoint_dir(self, step: int) -> str:
        return os.path.join(self.checkpoints, f"step_{step:06d}")

    def latest_checkpoint(self) -> str | None:
        pointer = os.path.join(self.checkpoints, "latest")
        if not os.path.exists(pointer):
            return None
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
        path = os.path.join(self.checkpoints, name)
        return path if os.path.exists(os.path.join(path, STATE_FILE)) else None

    def commit_checkpoint(self, tmp_dir: str, step: int, state: LoopState, keep: int) -> str:
        """Make a fully written checkpoint visible: state file, rename, then the ``latest`` pointer."""
        _write_json_atomic(os.path.join(tmp_dir, STATE_FILE), asdict(state))
        final = self.checkpoint_dir(step)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp_dir, final)
        _write_text_atomic(os.path.join(self.checkpoints, "latest"), os.path.basename(final))
        self._prune(keep)
        return final

    def staging_dir(self, step: int) -> str:
        path = os.path.join(self.checkpoints, f".tmp-step_{step:06d}")
        if os.path.exists(path):
            shutil.rmtree(path)
        os.makedirs(path)
        return path

    @staticmethod
    def read_state(checkpoint: str) -> LoopState:
        with open(os.path.join(checkpoint, STATE_FILE), encoding="utf-8") as f:
            return LoopState(**json.load(f))

    def _prune(self, keep: int) -> None:
        steps = sorted(d for d in os.listdir(self.checkpoints) if d.startswith("step_"))
        for name in steps[:-keep]:
            shutil.rmtree(os.path.join(self.checkpoints, name), ignore_errors=True)


def _write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json_atomic(path: str, obj: Any) -> None:
    _write_text_atomic(path, json.dumps(obj, indent=2))
