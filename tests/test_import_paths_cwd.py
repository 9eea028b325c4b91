"""``module:attr`` import paths resolve from the run's cwd with the ``miles`` console script too.

``python -m miles`` puts the cwd on ``sys.path``; the console script does not, so these
tests run the real ``.venv/bin/miles`` (and ``python -P``, which also leaves the cwd off
``sys.path``) from a directory holding the user's module, with no ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TINY = str(Path(__file__).parent / "data" / "recipes" / "tiny.yaml")
MILES = Path(sys.executable).parent / "miles"

USER_MODULE = """
def myreward(sample):
    return 1.0


def report_path(queue):
    queue.put(__file__)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # stevedore's per-sys.path entry-point cache
    return env


def test_console_script_resolves_an_import_path_from_the_cwd(tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    result = subprocess.run(
        [str(MILES), "config", "validate", TINY, "--set", "rollout.reward=mymod:myreward"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ok: {TINY}\n"


def test_a_missing_module_names_the_directory_searched(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(MILES), "config", "validate", TINY, "--set", "rollout.reward=nomod_here:myreward"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert (
        f"cannot find module 'nomod_here' (searched the installed packages and the current directory {tmp_path})"
        in (result.stderr)
    )


def test_spawned_rank_processes_import_the_same_path(tmp_path: Path) -> None:
    """Trainer ranks start with ``spawn`` and re-resolve the loss/correction import paths:
    the cwd must reach them through the ``sys.path`` multiprocessing hands to its children."""
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    code = (
        "import multiprocessing as mp, sys\n"
        "from miles.plugins import load_component\n"
        "assert load_component('reward', 'mymod:myreward')(None) == 1.0\n"
        # An installed package still wins over the cwd: the cwd is appended, not put first.
        "assert sys.path[-1] == sys.argv[1], sys.path\n"
        "import mymod\n"
        "ctx = mp.get_context('spawn')\n"
        "q = ctx.Queue()\n"
        "p = ctx.Process(target=mymod.report_path, args=(q,))\n"
        "p.start(); print('CHILD', q.get(timeout=60)); p.join(60)\n"
        "assert p.exitcode == 0\n"
    )
    result = subprocess.run(
        # -P: like the console script, do not put the cwd (or the script's directory) on sys.path.
        [sys.executable, "-P", "-c", code, str(tmp_path)],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"CHILD {tmp_path / 'mymod.py'}" in result.stdout
