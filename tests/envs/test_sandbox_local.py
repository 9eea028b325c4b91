"""The local provider doing its job: commands, files, reset, truncation, concurrency, lookup."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from pathlib import Path

import pytest

from miles.errors import ComponentError, ConfigError
from miles_envs.sandbox import (
    ExecReason,
    PathEscapeError,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxProvider,
    SandboxSpec,
    make_provider,
    provider_names,
)
from miles_envs.sandbox.local import LocalProvider, LocalSandbox

from .conftest import FAST, pids_of, with_sandbox


def test_exec_runs_in_the_workdir_with_the_spec_env(provider: LocalProvider) -> None:
    spec = SandboxSpec(files={"hello.txt": "hi there\n"}, env={"GREETING": "hallo"}, limits=FAST)

    async def body(sb: LocalSandbox) -> None:
        assert isinstance(sb, Sandbox)
        result = await sb.exec('pwd; cat hello.txt; echo "$GREETING"; echo oops >&2; exit 3')
        assert result.stdout == "/workspace\nhi there\nhallo\n"
        assert result.stderr == "oops\n"
        assert result.exit_code == 3 and result.reason is ExecReason.OK and not result.ok
        assert result.wall_s > 0 and not result.truncated
        # Nothing of the host's environment leaks in.
        env = await sb.exec("env")
        assert "HOME=/tmp" in env.stdout and "VIRTUAL_ENV" not in env.stdout and "UV_" not in env.stdout
        assert (await sb.exec("true")).ok

    with_sandbox(provider, body, spec)


def test_files_round_trip(provider: LocalProvider) -> None:
    async def body(sb: LocalSandbox) -> None:
        await sb.write_file("src/pkg/mod.py", "print('from file')\n")
        await sb.write_file("data.bin", bytes(range(256)))
        assert (await sb.exec("python3 src/pkg/mod.py")).stdout == "from file\n"
        # What the host wrote (file and the directories made for it) is the command's to change.
        edit = await sb.exec("echo more >> src/pkg/mod.py && touch src/pkg/new.py src/new.txt && rm data.bin")
        assert edit.ok, edit.stderr
        await sb.write_file("data.bin", bytes(range(256)))
        assert await sb.read_file("data.bin") == bytes(range(256))
        await sb.exec("mkdir -p out && printf 'made inside' > out/result.txt")
        assert await sb.read_file("out/result.txt") == b"made inside"
        assert await sb.read_file("./out/result.txt") == b"made inside"
        for bad in ("/etc/passwd", "../x", "out/../../x", "", "."):
            with pytest.raises(PathEscapeError):
                await sb.read_file(bad)
        with pytest.raises(FileNotFoundError):
            await sb.read_file("missing.txt")
        await sb.exec("mkfifo pipe")
        with pytest.raises(SandboxError, match="not a regular file"):
            await sb.read_file("pipe")

    with_sandbox(provider, body)


def test_reset_restores_the_starting_files(provider: LocalProvider) -> None:
    spec = SandboxSpec(files={"task/README": "solve me", "keep.txt": "v1"}, limits=FAST)

    async def body(sb: LocalSandbox) -> None:
        await sb.exec(
            "echo v2 > keep.txt; rm task/README; mkdir junk; touch junk/a new.txt; ln -s / rootlink"
        )
        await sb.reset()
        listing = await sb.exec("find . | sort")
        assert listing.stdout.split() == [".", "./keep.txt", "./task", "./task/README"]
        assert await sb.read_file("keep.txt") == b"v1"
        assert await sb.read_file("task/README") == b"solve me"

    with_sandbox(provider, body, spec)


def test_output_is_truncated_at_the_limit(provider: LocalProvider) -> None:
    limits = dataclasses.replace(FAST, output_bytes=1000)

    async def body(sb: LocalSandbox) -> None:
        flood = await sb.exec("yes 0123456789")
        assert flood.reason is ExecReason.OUTPUT_LIMIT and flood.truncated and flood.exit_code is None
        assert len(flood.stdout) == 1000 and flood.stdout.startswith("0123456789\n")
        assert pids_of(sb.id) == []
        both = await sb.exec("head -c 600 /dev/zero | tr '\\0' a; head -c 600 /dev/zero | tr '\\0' b >&2")
        assert both.truncated and len(both.stdout) + len(both.stderr) == 1000
        fits = await sb.exec("head -c 999 /dev/zero | tr '\\0' c")
        assert fits.ok and not fits.truncated and len(fits.stdout) == 999

    with_sandbox(provider, body, SandboxSpec(limits=limits))


def test_concurrent_sandboxes_run_side_by_side(provider: LocalProvider) -> None:
    async def go() -> None:
        boxes = [await provider.create(SandboxSpec(files={"id": str(i)}, limits=FAST)) for i in range(4)]
        try:
            started = time.monotonic()
            results = await asyncio.gather(*(b.exec("sleep 0.6; cat id") for b in boxes))
            elapsed = time.monotonic() - started
            assert [r.stdout for r in results] == ["0", "1", "2", "3"]
            # Four 0.6 s sleeps in sequence would take 2.4 s; side by side they overlap.
            assert elapsed < 2.2, elapsed
            assert len({b.root for b in boxes}) == 4
        finally:
            for b in boxes:
                await b.close()

    asyncio.run(go())


def test_parallel_execs_in_one_sandbox(provider: LocalProvider) -> None:
    """Parallel tool calls of one agent: each exec has its own namespaces over the same files."""

    async def body(sb: LocalSandbox) -> None:
        results = await asyncio.gather(
            *(sb.exec(f"sleep 0.2; echo {i} > out{i}; cat out{i}") for i in range(3))
        )
        assert [r.stdout.strip() for r in results] == ["0", "1", "2"]
        assert sorted((await sb.exec("ls")).stdout.split()) == ["out0", "out1", "out2"]

    with_sandbox(provider, body)


def test_close_and_health(provider: LocalProvider) -> None:
    async def go() -> None:
        sb = await provider.create(SandboxSpec(limits=FAST))
        assert (await sb.health()).alive
        await sb.close()
        await sb.close()  # twice is fine
        assert not (await sb.health()).alive
        for call in (sb.exec("true"), sb.read_file("x"), sb.write_file("x", "y"), sb.reset()):
            with pytest.raises(SandboxError, match="closed"):
                await call

    asyncio.run(go())


def test_provider_reports_its_isolation(provider: LocalProvider) -> None:
    assert isinstance(provider, SandboxProvider)
    report = provider.describe()
    assert report.kind == "namespaces"
    assert report.blocks_network and report.hides_host_files and report.kills_process_tree
    assert "unshare" in report.detail


def test_unreachable_base_dir_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only a provider running as root maps commands to another uid")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(SandboxError, match="not reachable by the sandbox uid"):
        LocalProvider(isolation="namespaces", base_dir=str(private))
    assert list(private.iterdir()) == []


def test_isolation_none_runs_only_when_asked_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """The control for the network test: without isolation the same connection succeeds."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="miles_envs.sandbox"):
        unisolated = LocalProvider(isolation="none")
    assert unisolated.describe().kind == "none" and not unisolated.describe().blocks_network
    assert any("isolation: none" in r.getMessage() for r in caplog.records)

    async def go() -> None:
        sb = await unisolated.create(SandboxSpec(limits=FAST))
        try:
            probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('CONNECTED')"
            result = await sb.exec(f'python3 -c "{probe}"')
            assert result.stdout.strip() == "CONNECTED"
            # Even unisolated, a process that left the group with setsid is swept at exec's end.
            await sb.exec("setsid sleep 30 & echo started")
            assert pids_of(sb.id) == []
        finally:
            await unisolated.aclose()
            server.close()

    asyncio.run(go())


def test_lookup_by_name_options_and_errors() -> None:
    assert "local-dir" in provider_names()
    with pytest.raises(ComponentError, match="did you mean 'local-dir'"):
        make_provider("local-dr")
    with pytest.raises(ConfigError, match="isolation"):
        make_provider("local-dir", {"isolation": "chroot"})
    with pytest.raises(ConfigError, match="isolaton"):
        make_provider("local-dir", {"isolaton": "none"})
    made = make_provider("miles_envs.sandbox.local:LocalProvider", {"isolation": "none"})
    assert made.describe().kind == "none"
    asyncio.run(made.aclose())
    with pytest.raises(ComponentError, match="cannot be imported"):
        make_provider("miles_envs.sandbox.local:Nope")


def test_limits_and_spec_are_validated() -> None:
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="processes"):
        SandboxLimits(processes=1)
    with pytest.raises(ValueError, match="cpu_s must be a positive integer"):
        SandboxLimits(cpu_s=1.5)  # type: ignore[arg-type]
    with pytest.raises(PathEscapeError):
        SandboxSpec(files={"../up": "x"})
    with pytest.raises(ValueError, match="env var"):
        SandboxSpec(env={"A=B": "x"})
