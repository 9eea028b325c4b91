"""Snapshots for the snapshot-based modes: one Hugging Face checkpoint per evaluated weight version.

Exporting is the one part of a snapshot evaluation that holds up training (a collective
on the trainer's ranks), so it runs on the driver thread; the rest runs in the background
and deletes the directory when it is done.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from miles.eval.result import EXPORT_FAILED, MISSING_SNAPSHOT, EvalSkipped


def snapshot_path(root: str, version: int) -> str:
    return os.path.join(root, f"v{version}")


def export_snapshot(export: Callable[[str], None], root: str, version: int) -> str:
    """Export weight version ``version`` to ``root/v{version}``; the directory, or ``EvalSkipped``."""
    path = snapshot_path(root, version)
    remove_snapshot(path)  # a leftover of an interrupted earlier attempt must not pass for this export
    os.makedirs(root, exist_ok=True)
    try:
        export(path)
    except Exception as exc:
        remove_snapshot(path)
        raise EvalSkipped(
            EXPORT_FAILED, f"exporting weight version {version} to {path} raised {type(exc).__name__}: {exc}"
        ) from exc
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "has no config.json" if os.path.isdir(path) else "does not exist"
        remove_snapshot(path)
        raise EvalSkipped(
            MISSING_SNAPSHOT,
            f"the export of weight version {version} returned, but {path} {what} (not a Hugging Face checkpoint)",
        )
    return path


def remove_snapshot(path: str | None) -> None:
    if path and os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
