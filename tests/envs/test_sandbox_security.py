"""The sandbox's promises, attacked: each attempt must fail and leave nothing running.

These run the real local provider with Linux namespaces (skipped, with the reason, where the
machine has no user namespaces); every command is a real process on this machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from miles_envs.sandbox import ExecReason, IsolationUnavailableError, PathEscapeError, SandboxSpec
from miles_envs.sandbox.local import LocalProvider, LocalSandbox

from .conftest import FAST, pids_of, with_sandbox


def test_write_outside_the_sandbox_is_refused(provider: LocalProvider, tmp_path: Path) -> None:
    target = tmp_path / "written-from-sandbox"

    async def body(sb: LocalSandbox) -> None:
        for command in (
            f"echo pwned > {target}",
            "echo pwned > ../escape",
            "echo pwned > /usr/pwned",
            "touch /pwned",
        ):
            result = await sb.exec(command)
            assert result.exit_code != 0, command
        assert not (sb.root.parent / "escape").exists()
        with pytest.raises(PathEscapeError):
            await sb.write_file("../escape", "x")
        with pytest.raises(PathEscapeError):
            await sb.write_file(str(target), "x")

    with_sandbox(provider, body)
    assert not target.exists()
    assert not Path("/usr/pwned").exists() and not Path("/pwned").exists()


def test_symlinks_out_lead_nowhere(provider: LocalProvider, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-42")
    outside_dir = tmp_path / "outside"
    outside_dir.mkdir()

    async def body(sb: LocalSandbox) -> None:
        # Inside, the host path does not exist: the link dangles.
        result = await sb.exec(f"ln -s {secret} link && ln -s {outside_dir} dirlink && cat link")
        assert result.exit_code != 0 and "TOP-SECRET" not in result.stdout
        # Outside, the host must not follow the sandbox's links either (they do resolve on the host).
        with pytest.raises(PathEscapeError):
            await sb.read_file("link")
        with pytest.raises(PathEscapeError):
            await sb.write_file("link", "overwritten")
        with pytest.raises(PathEscapeError):
            await sb.write_file("dirlink/planted", "x")
        with pytest.raises(PathEscapeError):
            await sb.read_file("dirlink/anything")

    with_sandbox(provider, body)
    assert secret.read_text() == "TOP-SECRET-42"
    assert list(outside_dir.iterdir()) == []


def test_host_files_are_not_visible(provider: LocalProvider, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET-7")

    async def body(sb: LocalSandbox) -> None:
        result = await sb.exec(f"cat {secret}; ls /work /root /home /.old 2>&1; cat /proc/1/root{secret}")
        assert "HOST-SECRET" not in result.stdout + result.stderr
        listing = await sb.exec("ls /")
        assert set(listing.stdout.split()) <= {
            "bin",
            "dev",
            "etc",
            "lib",
            "lib32",
            "lib64",
            "libx32",
            "proc",
            "sbin",
            "tmp",
            "usr",
            "workspace",
        }
        # No capability survives into the command, so nothing can be remounted writable.
        caps = await sb.exec("grep CapEff /proc/self/status")
        assert caps.stdout.split()[-1] == "0000000000000000"
        remount = await sb.exec("mount -o remount,rw /usr")
        assert remount.exit_code != 0

    with_sandbox(provider, body)


def test_network_is_unreachable(provider: LocalProvider) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('CONNECTED')"
    try:

        async def body(sb: LocalSandbox) -> None:
            result = await sb.exec(f'python3 -c "{probe}"')
            assert result.exit_code != 0 and "CONNECTED" not in result.stdout
            assert "unreachable" in result.stderr or "refused" in result.stderr, result.stderr
            ifaces = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1")
            assert ifaces.stdout.split() == ["lo"]

        with_sandbox(provider, body)
        # The host can reach its own server, so the failure above was the sandbox, not the server.
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        deadline = time.monotonic() + 2
        while len(accepted) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(accepted) == 1
    finally:
        stop.set()
        thread.join()
        server.close()


def test_fork_bomb_is_bounded_and_cleaned_up(provider: LocalProvider) -> None:
    limits = dataclasses.replace(FAST, processes=16)
    peak = [0]

    async def body(sb: LocalSandbox) -> None:
        async def watch() -> None:
            while True:
                peak[0] = max(peak[0], len(pids_of(sb.id)))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        started = time.monotonic()
        result = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 0.5", timeout_s=0.8)
        watcher.cancel()
        assert time.monotonic() - started < 3
        assert result.reason in (ExecReason.OK, ExecReason.TIMEOUT)
        assert pids_of(sb.id) == []

    with_sandbox(provider, body, SandboxSpec(limits=limits))
    # 16 processes inside the namespace, plus the unshare that holds it from outside.
    assert 2 <= peak[0] <= limits.processes + 1


def test_disk_fill_stops_at_the_file_size_limit(provider: LocalProvider) -> None:
    limits = dataclasses.replace(FAST, file_size_bytes=1 << 20, tmp_bytes=2 << 20)

    async def body(sb: LocalSandbox) -> None:
        result = await sb.exec("head -c 8000000 /dev/zero > big")
        assert result.reason is ExecReason.FILE_SIZE
        assert (sb.root / "big").stat().st_size <= 1 << 20
        # Many files under the per-file limit fill the private /tmp, which is size-limited.
        tmp = await sb.exec("for i in 1 2 3 4; do head -c 900000 /dev/zero > /tmp/f$i || exit 9; done")
        assert tmp.exit_code == 9 and "No space left" in tmp.stderr

    with_sandbox(provider, body, SandboxSpec(limits=limits))


def test_memory_beyond_the_limit_fails(provider: LocalProvider) -> None:
    limits = dataclasses.replace(FAST, memory_bytes=192 << 20)

    async def body(sb: LocalSandbox) -> None:
        result = await sb.exec("python3 -c 'x = bytearray(512 << 20); print(len(x))'")
        assert result.reason is ExecReason.OOM and result.exit_code != 0
        small = await sb.exec("python3 -c 'x = bytearray(16 << 20); print(len(x))'")
        assert small.ok and small.stdout.strip() == str(16 << 20)

    with_sandbox(provider, body, SandboxSpec(limits=limits))


def test_sleep_past_the_wall_clock_is_killed(provider: LocalProvider) -> None:
    async def body(sb: LocalSandbox) -> None:
        result = await sb.exec("sleep 30 & sleep 30", timeout_s=0.5)
        assert result.reason is ExecReason.TIMEOUT and result.exit_code is None
        assert 0.5 <= result.wall_s < 2.5
        assert pids_of(sb.id) == []

    with_sandbox(provider, body)


def test_cpu_time_limit(provider: LocalProvider) -> None:
    limits = dataclasses.replace(FAST, cpu_s=1)

    async def body(sb: LocalSandbox) -> None:
        result = await sb.exec("python3 -c 'while True: pass'", timeout_s=6)
        assert result.reason is ExecReason.CPU_LIMIT
        assert result.wall_s < 5

    with_sandbox(provider, body, SandboxSpec(limits=limits))


def test_background_processes_do_not_outlive_exec(provider: LocalProvider) -> None:
    async def body(sb: LocalSandbox) -> None:
        result = await sb.exec(
            "sleep 60 & setsid sleep 61 & (nohup sleep 62 >/dev/null 2>&1 &) ; echo started"
        )
        assert result.ok and result.stdout.strip() == "started"
        assert pids_of(sb.id) == []

    with_sandbox(provider, body)


def test_close_kills_running_commands(provider: LocalProvider) -> None:
    async def go() -> None:
        sb = await provider.create(SandboxSpec(limits=FAST))
        task = asyncio.create_task(sb.exec("sleep 60 & sleep 60 & wait", timeout_s=30))
        deadline = time.monotonic() + 5
        while len(sleeps(sb.id)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(sleeps(sb.id)) == 2
        await sb.close()
        result = await asyncio.wait_for(task, 3)
        assert result.reason is ExecReason.KILLED and result.exit_code is None
        assert pids_of(sb.id) == []
        assert not sb.root.exists()
        assert not (await sb.health()).alive

    asyncio.run(go())


def sleeps(sandbox_id: str) -> list[int]:
    """The sandbox's ``sleep`` processes (the setup's own short-lived processes carry the marker too)."""
    found = []
    for pid in pids_of(sandbox_id):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                found.append(pid)
        except OSError:
            continue
    return found


def test_sandboxes_cannot_see_each_other(provider: LocalProvider) -> None:
    async def go() -> None:
        a = await provider.create(SandboxSpec(files={"mine.txt": "A-ONLY"}, limits=FAST))
        b = await provider.create(SandboxSpec(limits=FAST))
        try:
            long_a = asyncio.create_task(a.exec("sleep 1", timeout_s=3))
            seen = await b.exec(f"cat {a.root}/mine.txt; ls /proc | grep -c '^[0-9]'")
            assert "A-ONLY" not in seen.stdout
            assert int(seen.stdout.split()[-1]) <= 3  # its own shell, grep and ls: not a's sleep
            await long_a
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_no_isolation_is_refused_unless_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A PATH without util-linux: the namespace tools are missing, so auto must refuse, not degrade.
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for isolation in ("auto", "namespaces"):
        with pytest.raises(IsolationUnavailableError, match="isolation: none"):
            LocalProvider(isolation=isolation)  # type: ignore[arg-type]


_CRASHING_HOST = """
import asyncio, sys
from miles_envs.sandbox import SandboxSpec
from miles_envs.sandbox.local import LocalProvider

async def main():
    sb = await LocalProvider(isolation="namespaces", base_dir=sys.argv[1]).create(SandboxSpec())
    print(sb.id, flush=True)
    await sb.exec("sleep 60 & sleep 60", timeout_s=0.5)

asyncio.run(main())
"""


def test_commands_die_even_when_miles_is_killed_mid_exec(provider: LocalProvider) -> None:
    """Nobody is left to enforce the wall clock: the backstop (coreutils timeout) must."""
    # The crashed host cannot clean its sandbox directory up: give it one this test removes.
    base = Path(tempfile.mkdtemp(prefix="miles-sandbox-crash-"))
    os.chmod(base, 0o755)
    host = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_HOST, str(base)], stdout=subprocess.PIPE, text=True
    )
    assert host.stdout is not None
    sandbox_id = host.stdout.readline().strip()
    deadline = time.monotonic() + 5
    while len(sleeps(sandbox_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(sleeps(sandbox_id)) == 2, "the command never started"
    host.kill()
    host.wait()
    deadline = time.monotonic() + 0.5 + 2.0 + 3.0  # wall, backstop grace, slack for a loaded machine
    while pids_of(sandbox_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_of(sandbox_id) == []
    shutil.rmtree(base)
