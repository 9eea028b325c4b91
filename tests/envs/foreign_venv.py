"""Virtual environments for frameworks that do not install on Miles' Python (NeMo Gym needs 3.12+).

Such a framework runs in a process of its own, as it does outside Miles, from a venv built here
once per pinned requirements file (``$MILES_CACHE_DIR/test-venvs/<name>-<hash>``) with ``uv`` and
the first Python 3.12 or newer found on this machine. Tests skip, saying why, only when there is
no such Python or no ``uv``; an install that fails is a test error (CI reaches PyPI).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _version(python: str) -> tuple[int, int] | None:
    try:
        done = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:  # a pyenv shim for a version it does not select fails here
        return None
    major, minor = done.stdout.split()
    return int(major), int(minor)


def find_python(minimum: tuple[int, int]) -> str | None:
    """The oldest Python interpreter at least ``minimum`` (the requirements files are pinned for it).

    Looked for in $MILES_TEST_PYTHON (used alone when set), on PATH, by uv, and among pyenv's versions.
    """
    if os.environ.get("MILES_TEST_PYTHON"):
        return os.environ["MILES_TEST_PYTHON"]
    candidates = [shutil.which(f"python3.{m}") or "" for m in range(minimum[1], 16)]
    uv = shutil.which("uv")
    if uv is not None:
        found = subprocess.run(
            [uv, "python", "find", "--no-python-downloads", f">={minimum[0]}.{minimum[1]}"],
            capture_output=True,
            text=True,
        )
        candidates.append(found.stdout.strip() if found.returncode == 0 else "")
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += glob.glob(f"{pyenv_root}/versions/3.*/bin/python3")
    found = []
    for python in dict.fromkeys(c for c in candidates if c):
        version = _version(python)
        if version is not None and version >= minimum:
            found.append((version, python))
    return min(found)[1] if found else None


def venv_python(name: str, requirements: Path, minimum: tuple[int, int]) -> Path:
    """The Python of a venv holding ``requirements`` (built on first use); skips when it cannot be."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip(f"{name}: uv is not installed")
    base = find_python(minimum)
    if base is None:
        pytest.skip(f"{name} needs Python >= {minimum[0]}.{minimum[1]}, and none is installed here")
    digest = hashlib.sha256(requirements.read_bytes() + base.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("MILES_CACHE_DIR", ROOT / ".miles-cache")) / "test-venvs"
    target = cache / f"{name}-{digest}"
    if (target / "bin" / "python").exists():
        return target / "bin" / "python"
    cache.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed into place, so a build cut short never passes for a finished one.
    staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=cache))
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "VIRTUAL_ENV": ""}
    for argv in (
        [uv, "venv", "--quiet", "--allow-existing", "--relocatable", "--python", base, str(staging)],
        [
            uv,
            "pip",
            "install",
            "--quiet",
            "--python",
            str(staging / "bin" / "python"),
            "-r",
            str(requirements),
        ],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"building the {name} venv failed: {' '.join(argv)}\n{done.stderr[-4000:]}")
    try:
        staging.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target / "bin" / "python"
