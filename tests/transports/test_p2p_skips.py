"""Without libibverbs the P2P tests skip with the reason, never fail: `uv run pytest` passes on a
fresh machine (only `.ci/run` installs libibverbs1).

Mooncake installed without its system library fails to import with a plain ImportError (not
ModuleNotFoundError). A pytest plugin in the child process makes ``import mooncake.engine`` fail
exactly so, whether or not this machine has the library, and the P2P tests are run there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
MISSING = "libibverbs.so.1: cannot open shared object file: No such file or directory"

# Loaded with `-p` before any test module is imported, so every `import mooncake...` sees it.
HIDE_LIBIBVERBS = f"""
import importlib.abc
import sys


class _NoLibibverbs(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mooncake" or name.startswith("mooncake."):
            raise ImportError({MISSING!r})
        return None


for name in [n for n in sys.modules if n == "mooncake" or n.startswith("mooncake.")]:
    del sys.modules[name]
sys.meta_path.insert(0, _NoLibibverbs())
"""

P2P_TESTS = [
    "tests/e2e/test_transport_runs.py::test_p2p_run_with_the_fsdp_backend",
    "tests/transports/test_p2p.py::test_an_engine_that_cannot_be_reached_fails_connect_naming_it",
]


def test_p2p_tests_skip_with_the_reason_when_libibverbs_is_missing(tmp_path: Path) -> None:
    (tmp_path / "hide_libibverbs.py").write_text(HIDE_LIBIBVERBS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "hide_libibverbs",
            "-p",
            "no:cacheprovider",
            "-rs",
            "-q",
            *P2P_TESTS,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("2 skipped in "), out  # nothing passed, failed or errored
    assert out.count(f"Mooncake is not importable (ImportError: {MISSING})") == 2, out
