"""Where built-in models live on disk, and how a build lands there safely.

A build writes into a temporary folder next to its destination and is renamed into
place only when complete, so a crash never leaves a half-written model that later
looks valid. A lock file serialises concurrent builders (two test workers, two
engines starting at once): the second one waits, then finds the model built.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_root() -> Path:
    """``$MILES_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/miles/models``, else ``~/.cache/miles/models``."""
    if env := os.environ.get("MILES_CACHE_DIR"):
        return Path(env).expanduser() / "models"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "miles" / "models"


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_atomically(dest: Path, build: Callable[[Path], None], *, force: bool = False) -> Path:
    """Run ``build(tmp_dir)`` and move the result to ``dest``; skip if ``dest`` exists (unless ``force``)."""
    dest = Path(dest)
    with _exclusive(dest.parent / f".{dest.name}.lock"):
        if dest.exists() and not force:
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model cache is ordinary data
            build(tmp)
            if dest.exists():
                # Move the old copy aside first so dest is never missing-and-half-written.
                old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
                os.replace(dest, old / "model")
                os.replace(tmp, dest)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest
