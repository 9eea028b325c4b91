"""The sandbox contract: what an environment asks of a place where untrusted commands run.

The interface is asynchronous because its caller is an agent's tool loop inside a rollout, and
the rollout runs many episodes concurrently on one asyncio event loop: a command that runs for
ten seconds must not stop the other episodes' turns. Every blocking step (spawning, waiting,
file copies) is awaited, so a provider backed by a remote service fits the same contract.

A provider makes sandboxes from a :class:`SandboxSpec` (starting files, limits, environment);
a :class:`Sandbox` runs commands (:meth:`Sandbox.exec` -> :class:`ExecResult`), reads and
writes files by paths relative to its root, reports its health, restores its starting files
(:meth:`Sandbox.reset`, for a long-lived sandbox reused across episodes) and is closed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Protocol, runtime_checkable


class SandboxError(Exception):
    """A sandbox could not do what was asked (closed, refused path, failed to start)."""


class PathEscapeError(SandboxError):
    """A file path given to read/write would leave the sandbox root (absolute, ``..``, a symlink)."""


class IsolationUnavailableError(SandboxError):
    """The isolation a provider was asked for cannot run on this machine."""


class ExecReason(enum.StrEnum):
    """Why a command stopped. ``ok`` means it ended by itself within every limit (any exit code)."""

    OK = "ok"
    TIMEOUT = "timeout"  # wall-clock limit: the whole process tree was killed
    CPU_LIMIT = "cpu_limit"  # RLIMIT_CPU: the kernel sent SIGXCPU / SIGKILL
    OUTPUT_LIMIT = "output_limit"  # stdout+stderr passed the output limit: killed, output truncated
    FILE_SIZE = "file_size"  # RLIMIT_FSIZE: a write past the file-size limit (SIGXFSZ)
    OOM = "oom"  # an allocation failed at the memory limit
    KILLED = "killed"  # killed by a signal nobody in the sandbox asked for (e.g. SIGKILL from outside)


@dataclass(frozen=True)
class SandboxLimits:
    """Per-command limits. Each process of a command gets the memory, CPU and file-size limits;
    the process count and wall clock cover the whole command (its process tree)."""

    wall_s: float = 30.0  # default wall-clock limit of one exec (exec's timeout_s overrides it)
    cpu_s: int = 30  # CPU seconds per process (RLIMIT_CPU)
    memory_bytes: int = 1 << 30  # address space per process (RLIMIT_AS)
    processes: int = (
        64  # processes and threads alive at once in one command (RLIMIT_NPROC in its own user namespace)
    )
    file_size_bytes: int = 64 << 20  # largest file a process may write (RLIMIT_FSIZE)
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 64 << 10  # stdout + stderr kept per exec; more kills the command
    tmp_bytes: int = 64 << 20  # size of the private /tmp (a tmpfs, fresh per exec)

    def __post_init__(self) -> None:
        if isinstance(self.wall_s, bool) or not isinstance(self.wall_s, int | float) or self.wall_s <= 0:
            raise ValueError(
                f"sandbox limit wall_s must be a positive number of seconds, got {self.wall_s!r}"
            )
        # The others become rlimits and tmpfs sizes, which take whole numbers.
        for name in (
            "cpu_s",
            "memory_bytes",
            "processes",
            "file_size_bytes",
            "open_files",
            "output_bytes",
            "tmp_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"sandbox limit {name} must be a positive integer, got {value!r}")
        if self.processes < 2:
            raise ValueError("sandbox limit processes must be at least 2 (the shell and one command)")


FileContent = bytes | str


@dataclass(frozen=True)
class SandboxSpec:
    """What a new sandbox starts with: files (relative path -> content), limits, environment variables."""

    files: Mapping[str, FileContent] = field(default_factory=dict)
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for path in self.files:
            check_relative(path)
        for key, value in self.env.items():
            if not key or "=" in key or "\0" in key or not isinstance(value, str) or "\0" in value:
                raise ValueError(f"sandbox env var {key!r}={value!r} is not a valid environment entry")


def check_relative(path: str) -> PurePosixPath:
    """``path`` as a relative path with no ``..``; raises :class:`PathEscapeError` otherwise."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise PathEscapeError(f"sandbox path must be a non-empty string, got {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise PathEscapeError(f"sandbox path {path!r} is absolute; give a path relative to the sandbox root")
    if ".." in pure.parts:
        raise PathEscapeError(f"sandbox path {path!r} contains '..'")
    if not pure.parts or pure.parts == (".",):
        raise PathEscapeError(f"sandbox path {path!r} names the root itself, not a file")
    return pure


@dataclass(frozen=True)
class ExecResult:
    """What one command did. ``stdout``/``stderr`` are decoded as UTF-8 (bad bytes replaced)."""

    exit_code: int | None  # None when the command was killed before it could exit
    stdout: str
    stderr: str
    truncated: bool  # output passed limits.output_bytes and was cut
    wall_s: float
    reason: ExecReason
    signal: int | None = None  # the signal that ended the command, when one did

    @property
    def ok(self) -> bool:
        """Ended by itself, within every limit, with exit code 0."""
        return self.reason is ExecReason.OK and self.exit_code == 0


@dataclass(frozen=True)
class SandboxHealth:
    alive: bool
    detail: str


@dataclass(frozen=True)
class IsolationReport:
    """Which isolation a provider runs commands under, and what that protects."""

    kind: str  # "namespaces" or "none"
    detail: str  # one line for the run log
    blocks_network: bool
    hides_host_files: bool
    kills_process_tree: bool
    extra: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Sandbox(Protocol):
    """One sandbox: a root directory in which commands run under its limits."""

    @property
    def id(self) -> str: ...

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` with ``/bin/sh -c`` in the sandbox root; ``timeout_s`` defaults to limits.wall_s.

        Every process the command started is gone when this returns."""
        ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, content: FileContent) -> None: ...

    async def health(self) -> SandboxHealth: ...

    async def reset(self) -> None:
        """Restore the starting files (everything else in the root is removed)."""
        ...

    async def close(self) -> None:
        """Kill anything still running and remove the sandbox; closing twice is a no-op."""
        ...


@runtime_checkable
class SandboxProvider(Protocol):
    """Makes sandboxes; one provider serves a whole run."""

    def describe(self) -> IsolationReport: ...

    async def create(self, spec: SandboxSpec) -> Sandbox: ...

    async def aclose(self) -> None:
        """Close every sandbox this provider made that is still open."""
        ...
