"""Fixtures for the sandbox tests: a real local provider (namespaces where this machine has them)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from miles_envs.sandbox import IsolationUnavailableError, SandboxLimits, SandboxSpec
from miles_envs.sandbox.local import LocalProvider, LocalSandbox

T = TypeVar("T")

# Sub-second wall clocks keep the suite fast on a shared 2-core machine.
FAST = SandboxLimits(
    wall_s=5.0, cpu_s=5, memory_bytes=512 << 20, processes=32, file_size_bytes=8 << 20, output_bytes=16 << 10
)


def namespaces_missing() -> str | None:
    """Why user namespaces cannot be used here, or None (checked the way the provider will use them)."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount", "true"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return f"user namespaces are not available: {done.stderr.strip()}"
    return None


@pytest.fixture(scope="session")
def provider() -> Iterator[LocalProvider]:
    reason = namespaces_missing()
    if reason is not None:
        pytest.skip(reason)
    try:
        # The system temp dir: pytest's own tmp dirs are 0700, which the sandbox uid cannot traverse.
        made = LocalProvider(isolation="namespaces")
    except IsolationUnavailableError as err:
        pytest.skip(str(err))
    yield made
    asyncio.run(made.aclose())


def run(coro: Awaitable[T]) -> T:
    async def wrap() -> T:
        return await coro

    return asyncio.run(wrap())


def with_sandbox(
    provider: LocalProvider, body: Callable[[LocalSandbox], Awaitable[T]], spec: SandboxSpec | None = None
) -> T:
    """Run ``body`` on a fresh sandbox, closed afterwards (even when the body fails)."""

    async def go() -> T:
        sandbox = await provider.create(spec or SandboxSpec(limits=FAST))
        try:
            return await body(sandbox)
        finally:
            await sandbox.close()

    return asyncio.run(go())


def pids_of(sandbox_id: str) -> list[int]:
    """Every live process started by an exec of this sandbox (they carry MILES_SANDBOX=<id>-...)."""
    prefix = f"MILES_SANDBOX={sandbox_id}-".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and any(e.startswith(prefix) for e in env):
            found.append(int(name))
    return found
