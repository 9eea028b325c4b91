"""Attaching to (or starting) a Ray cluster, and reserving resources in it, with clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from miles.errors import ConfigError
from miles.placement import PlacementError, placement_group_for, remove_placement_group


def _run(code: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A fresh driver process (as `miles run` is), so its Ray connection is its own."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_a_placement_group_the_cluster_cannot_hold_fails_at_once_naming_what_is_missing(ray_cluster):
    start = time.monotonic()
    with pytest.raises(PlacementError) as info:
        placement_group_for([{"CPU": 3}] * 2, "miles-test-too-big")
    text = str(info.value)
    assert "miles-test-too-big" in text and "{CPU: 6}" in text and "missing {CPU: 2}" in text
    with pytest.raises(PlacementError, match=r"missing \{GPU: 1\}"):
        placement_group_for([{"GPU": 1}], "miles-test-no-gpu")
    assert time.monotonic() - start < 5


def test_resources_that_exist_but_are_taken_time_out_with_what_is_free(ray_cluster):
    import ray

    free = int(ray.available_resources()["CPU"])
    held = placement_group_for([{"CPU": 1}] * free, "miles-test-hold")
    try:
        with pytest.raises(PlacementError, match=r"(?s)not placed within 1 s.*in use"):
            placement_group_for([{"CPU": 1}], "miles-test-wait", timeout_s=1)
    finally:
        remove_placement_group(held)
    group = placement_group_for([{"CPU": 1}], "miles-test-after")  # the CPUs are back
    remove_placement_group(group)


def test_bad_bundles_and_a_missing_ray_are_one_clear_error(ray_cluster, monkeypatch):
    with pytest.raises(ConfigError, match="must ask for some resource"):
        placement_group_for([{"CPU": 0}], "miles-test-empty")
    with pytest.raises(ConfigError, match="must be a number"):
        placement_group_for([{"CPU": "one"}], "miles-test-bad")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as where it is not installed
    from miles.placement import ray_session

    with pytest.raises(ConfigError, match=r"pip install 'miles-core\[ray\]'"), ray_session(None):
        pass


def test_attaching_reports_the_cluster_and_an_unreachable_address_fails_fast(ray_address):
    attach = _run(
        f"""
        import json, ray
        from miles.placement import ray_session
        with ray_session({ray_address!r}) as c:
            print(json.dumps([c.address, c.node_ip, c.started, ray.cluster_resources()["CPU"]]))
        print(json.dumps(ray.is_initialized()))
        """
    )
    assert attach.returncode == 0, attach.stderr[-3000:]
    lines = attach.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == [ray_address, "127.0.0.1", False, 4.0]
    assert json.loads(lines[-1]) is False  # disconnected on exit; the cluster itself keeps running

    start = time.monotonic()
    refused = _run(
        """
        from miles.placement import PlacementError, ray_session
        try:
            with ray_session("127.0.0.1:1"):
                pass
        except PlacementError as exc:
            print("ERROR", exc)
        """
    )
    assert time.monotonic() - start < 30
    assert "ERROR cannot reach the Ray cluster at '127.0.0.1:1'" in refused.stdout, refused.stderr[-3000:]
    assert "ray start --head" in refused.stdout


@pytest.mark.slow
def test_no_address_starts_a_private_loopback_cluster_and_stops_it(ray_address):
    # ray_address: the session cluster must not be picked up instead of starting a private one.
    # The private cluster's files go to a temp root of our own (short: Ray's socket paths are limited).
    temp_root = tempfile.mkdtemp(prefix="mray-", dir="/tmp")
    try:
        private = _run(
            """
        import json, socket, ray
        from miles.placement import ray_session
        with ray_session(None, num_cpus=2) as c:
            info = [c.node_ip, c.started, ray.cluster_resources()["CPU"]]
            host, port = c.address.rsplit(":", 1)
        print(json.dumps(info + [host]))
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            print("STILL LISTENING")
        except OSError:
            print("STOPPED")
        """,
            env={"RAY_TMPDIR": temp_root},
        )
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    assert private.returncode == 0, private.stderr[-3000:]
    lines = private.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == ["127.0.0.1", True, 2.0, "127.0.0.1"]
    assert lines[-1] == "STOPPED"
