"""A real local Ray cluster for the placement tests: started with Ray's own CLI, stopped at the end.

``ray start --head`` on 127.0.0.1 (Ray's single-machine mode keeps it off the network),
with its own temp dir and process group so that stopping it ends exactly this cluster's
processes and no other Ray cluster on the machine (``ray stop`` would end them all).
Tests are skipped only where ``import ray`` fails.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The rank actors import test components by path (``fsdp.components:...``) through the driver's sys.path.
TESTS_DIR = str(Path(__file__).resolve().parents[1])
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

# For this process (before anything imports ray) and the cluster it starts: keep 127.0.0.1 as the
# node address, never ship the working tree through `uv run`, report nothing home, and require a
# fresh token that only this test session knows (nothing is written to ~/.ray).
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)

# The tiny model and the backend starter are the FSDP tests' own (the Ray rank group runs the same backend).
from fsdp.conftest import tiny_model  # noqa: E402, F401

_STOP_GRACE_S = 1.0  # Ray's daemons often ignore SIGTERM; the cluster is thrown away anyway


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies, already dead, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _stop(pgid: int) -> None:
    """SIGTERM the cluster's process group, then SIGKILL whatever is left after a grace period."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """HOST:PORT of a fresh head node (4 CPUs, no dashboard) for the whole test session."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"ray is not installed ({exc}); pip install 'miles-core[ray]'")
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="mray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--num-cpus=4",
        "--num-gpus=0",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    # Its own session: every daemon `ray start` leaves behind shares the process group we stop at the end.
    proc = subprocess.Popen(
        cmd,
        env=dict(os.environ),  # the same Ray settings as this process (set above)
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            pytest.fail(f"`ray start --head` failed (exit {proc.returncode}):\n{out[-3000:]}")
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        _stop(proc.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster(ray_address: str):
    """This test process attached to the cluster (as a run with placement.ray_address does)."""
    from miles.placement import ray_session

    with ray_session(ray_address) as cluster:
        yield cluster
