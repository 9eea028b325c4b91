"""The run directory: what a run writes, and the rules that keep earlier results safe.

Layout::

    RUN_DIR/config.yaml            the resolved recipe
    RUN_DIR/metrics.jsonl          one row per step
    RUN_DIR/tensorboard/           event files
    RUN_DIR/engines/               engine logs
    RUN_DIR/checkpoints/step_N/    resumable: trainer/ (backend state) + state.json (loop state)
    RUN_DIR/checkpoints/latest     name of the newest complete checkpoint (written last)
    RUN_DIR/final/                 Hugging Face checkpoint of the final policy
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

from miles.errors import RunDirError

STATE_FILE = "state.json"


@dataclass
class LoopState:
    """Everything besides the trainer's own state that a resumed run needs."""

    step: int = 0  # the next step to run
    weight_version: int = 0  # the version the engines must serve
    data_source: dict[str, Any] = field(default_factory=dict)


class RunDir:
    def __init__(self, path: str) -> None:
        self.path = path

    def sub(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def checkpoints(self) -> str:
        return self.sub("checkpoints")

    def check(self, *, resume: bool, overwrite: bool) -> None:
        """Refuse to clobber earlier results unless asked; writes nothing."""
        if resume and overwrite:
            raise RunDirError("--resume and --overwrite contradict each other; pass one")
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise RunDirError(f"run directory {self.path} exists and is not a directory")
        existing = sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []
        if resume and self.latest_checkpoint() is None:
            raise RunDirError(
                f"--resume: no complete checkpoint under {self.checkpoints}; "
                "a run saves one every run.save_every steps"
            )
        if existing and not resume and not overwrite:
            raise RunDirError(
                f"run directory {self.path} already holds results ({', '.join(existing[:4])}); "
                "pass --resume to continue it, --overwrite to replace it, or choose another run.name"
            )

    def prepare(self, *, resume: bool, overwrite: bool) -> None:
        """Check, then create the directory (emptied first with ``overwrite``)."""
        self.check(resume=resume, overwrite=overwrite)
        if overwrite and os.path.isdir(self.path):
            shutil.rmtree(self.path)
        os.makedirs(self.path, exist_ok=True)

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
