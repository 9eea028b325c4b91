"""The local sandbox provider: each sandbox is a directory on this machine; commands run isolated
by Linux namespaces (see :mod:`miles_envs.sandbox.isolation`) under rlimits and a wall clock.

Every exec is its own set of namespaces, so a command's processes cannot outlive it: the
sandbox's state between commands is its files, nothing else (no background server survives
from one tool call to the next; ``/tmp`` is fresh per exec).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles_envs.sandbox import paths
from miles_envs.sandbox.base import (
    ExecReason,
    ExecResult,
    FileContent,
    IsolationReport,
    SandboxError,
    SandboxHealth,
    SandboxLimits,
    SandboxSpec,
)
from miles_envs.sandbox.isolation import (
    RESERVED,
    Launcher,
    check_reachable,
    clean_env,
    detect,
    pids_with_marker,
    setup_failure,
)

log = logging.getLogger("miles_envs.sandbox")

# What allocators print when RLIMIT_AS refuses them (Python, glibc tools, C++): RLIMIT_AS makes
# an allocation fail rather than raising a kernel OOM event, so the failure message is the signal.
_OOM_MARKERS = re.compile(rb"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory", re.IGNORECASE)
_READ_CHUNK = 65536
_DRAIN_AFTER_KILL_S = 2.0


class LocalProviderOptions(ComponentOptions):
    """Options of the ``local-dir`` sandbox provider (``sandbox.options`` in a recipe)."""

    isolation: Literal["auto", "namespaces", "none"] = Field(
        "auto",
        description="auto/namespaces: Linux namespaces, refused at start when they do not work here; "
        "none: no isolation (rlimits only), only for trusted commands",
    )
    base_dir: str | None = Field(
        None, description="where sandbox directories are made (default: the system temp dir)"
    )
    workdir: str = Field("/workspace", description="the path at which a command sees its sandbox directory")
    sandbox_uid: int = Field(65534, ge=1, description="the host uid commands run as when miles runs as root")


class LocalProvider:
    """Makes :class:`LocalSandbox` es; probes the isolation once, when built."""

    Options = LocalProviderOptions

    def __init__(
        self,
        isolation: Literal["auto", "namespaces", "none"] = "auto",
        base_dir: str | None = None,
        workdir: str = "/workspace",
        sandbox_uid: int = 65534,
    ) -> None:
        parts = [p for p in workdir.split("/") if p]
        if not workdir.startswith("/") or not parts or ".." in parts or parts[0] in RESERVED:
            raise ValueError(
                f"sandbox workdir must be an absolute path outside /{', /'.join(RESERVED)}, got {workdir!r}"
            )
        self._base = Path(tempfile.mkdtemp(prefix="miles-sandboxes-", dir=base_dir))
        os.chmod(self._base, 0o711)  # the unprivileged sandbox uid must reach its own directory
        try:
            if isolation != "none" and os.geteuid() == 0:
                check_reachable(self._base, sandbox_uid)
            self._launcher, self._report = detect(isolation, "/" + "/".join(parts), sandbox_uid, self._base)
        except BaseException:
            shutil.rmtree(self._base, ignore_errors=True)
            raise
        if self._report.kind == "none":
            log.warning("sandbox provider local-dir: %s", self._report.detail)
        else:
            log.info("sandbox provider local-dir: %s", self._report.detail)
        self._open: dict[str, LocalSandbox] = {}

    def describe(self) -> IsolationReport:
        return self._report

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        sandbox_id = uuid.uuid4().hex[:12]
        sandbox = LocalSandbox(sandbox_id, self._base / sandbox_id, spec, self._launcher, self._forget)
        await asyncio.to_thread(sandbox.populate)
        self._open[sandbox_id] = sandbox
        return sandbox

    async def aclose(self) -> None:
        for sandbox in list(self._open.values()):
            await sandbox.close()
        await asyncio.to_thread(shutil.rmtree, self._base, True)

    def _forget(self, sandbox_id: str) -> None:
        self._open.pop(sandbox_id, None)


class LocalSandbox:
    """A directory and the commands running in it (see the module docstring)."""

    def __init__(
        self,
        sandbox_id: str,
        home: Path,
        spec: SandboxSpec,
        launcher: Launcher,
        on_close: Callable[[str], None],
    ) -> None:
        self._id = sandbox_id
        self._home = home  # holds root/ (what the command sees) and mnt/ (mount point of its private root)
        self.root = home / "root"
        self._mnt = home / "mnt"
        self._spec = spec
        self._launcher = launcher
        self._on_close = on_close
        self._running: set[asyncio.subprocess.Process] = set()
        self._closed = False

    @property
    def id(self) -> str:
        return self._id

    @property
    def limits(self) -> SandboxLimits:
        return self._spec.limits

    # ------------------------------------------------------------------ files

    def populate(self) -> None:
        """Make the directory and write the starting files (also what reset restores)."""
        self._home.mkdir(mode=0o711)
        self._mnt.mkdir()
        self.root.mkdir(mode=0o755, exist_ok=True)
        if self._launcher.owner is not None:
            os.chown(self.root, *self._launcher.owner)
        for path, content in self._spec.files.items():
            paths.write_bytes(self.root, path, _as_bytes(content), self._launcher.owner)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        return await asyncio.to_thread(paths.read_bytes, self.root, path)

    async def write_file(self, path: str, content: FileContent) -> None:
        self._check_open()
        await asyncio.to_thread(paths.write_bytes, self.root, path, _as_bytes(content), self._launcher.owner)

    async def reset(self) -> None:
        self._check_open()
        await self._kill_running()
        await asyncio.to_thread(self._restore)

    def _restore(self) -> None:
        paths.empty_dir(self.root)
        for path, content in self._spec.files.items():
            paths.write_bytes(self.root, path, _as_bytes(content), self._launcher.owner)

    async def health(self) -> SandboxHealth:
        if self._closed:
            return SandboxHealth(False, "closed")
        if not self.root.is_dir():
            return SandboxHealth(False, f"sandbox directory {self.root} is gone")
        return SandboxHealth(True, f"{len(self._running)} command(s) running")

    # --------------------------------------------------------------- commands

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        self._check_open()
        if not isinstance(command, str) or "\0" in command:
            raise SandboxError(f"sandbox command must be a string without NUL bytes, got {command!r}")
        limits = self._spec.limits
        wall = limits.wall_s if timeout_s is None else timeout_s
        if wall <= 0:
            raise SandboxError(f"exec timeout_s must be positive, got {timeout_s!r}")
        marker = f"{self._id}-{uuid.uuid4().hex[:8]}"
        nonce = uuid.uuid4().hex
        argv = self._launcher.argv(command, self.root, self._mnt, limits, nonce, wall)
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=clean_env(self._spec.env, marker),
            cwd=self.root if self._launcher.kind == "none" else None,
            start_new_session=True,  # one process group to kill, the unshare and its PID 1 included
        )
        self._running.add(proc)
        try:
            outcome = await self._collect(proc, wall, limits.output_bytes)
        finally:
            self._kill(proc)
            if self._launcher.kind == "none":
                await self._sweep(marker)
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
            self._running.discard(proc)
        elapsed = time.monotonic() - started
        out, err, truncated, stopped = outcome
        failed = setup_failure(err, nonce) if proc.returncode != 0 else None
        if failed is not None:
            # The sandbox broke, not the command: an infrastructure error, never the model's result.
            raise SandboxError(f"sandbox {self._id}: setting up the isolated root failed: {failed}")
        return _result(proc.returncode, out, err, truncated, elapsed, stopped)

    async def _collect(
        self, proc: asyncio.subprocess.Process, wall: float, limit: int
    ) -> tuple[bytes, bytes, bool, ExecReason | None]:
        """Read both streams until the command exits, passes the output limit or the wall clock."""
        assert proc.stdout is not None and proc.stderr is not None
        kept = {1: bytearray(), 2: bytearray()}
        over = asyncio.Event()

        async def pump(stream: asyncio.StreamReader, key: int) -> None:
            # Past the limit the stream is still read (and dropped) until it closes, so the pipe
            # transport ends cleanly once the kill has emptied the namespace.
            while chunk := await stream.read(_READ_CHUNK):
                room = limit - len(kept[1]) - len(kept[2])
                kept[key] += chunk[: max(room, 0)]
                if len(chunk) > room:
                    over.set()

        pumps = asyncio.gather(pump(proc.stdout, 1), pump(proc.stderr, 2))
        over_wait = asyncio.ensure_future(over.wait())
        done_wait = asyncio.ensure_future(_wait_all(proc, pumps))
        stopped: ExecReason | None = None
        try:
            done, _ = await asyncio.wait(
                {over_wait, done_wait}, timeout=wall, return_when=asyncio.FIRST_COMPLETED
            )
            if over_wait in done:
                stopped = ExecReason.OUTPUT_LIMIT
            elif done_wait not in done:
                stopped = ExecReason.TIMEOUT
        finally:
            over_wait.cancel()
            if stopped is not None or not done_wait.done():
                self._kill(proc)
                # Pipes close when the last holder dies; in the unisolated mode a process that
                # escaped the group may hold them, so the drain is bounded.
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(done_wait), _DRAIN_AFTER_KILL_S)
                done_wait.cancel()
                pumps.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pumps
        return bytes(kept[1]), bytes(kept[2]), stopped is ExecReason.OUTPUT_LIMIT, stopped

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    @staticmethod
    async def _sweep(marker: str) -> None:
        """Unisolated mode: kill what left the process group (``setsid``) but kept the exec's marker.

        Best effort, and repeated until two passes in a row find nothing: a process caught
        mid-``execve`` has no readable environment for a moment, and one may fork while we kill.
        """
        quiet = 0
        for _ in range(50):
            found = pids_with_marker(marker, exclude=(os.getpid(),))
            for pid in found:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            quiet = 0 if found else quiet + 1
            if quiet >= 2:
                return
            await asyncio.sleep(0.01)

    async def _kill_running(self) -> None:
        for proc in list(self._running):
            self._kill(proc)
        for proc in list(self._running):
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()

    # ------------------------------------------------------------------ close

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._kill_running()
        await asyncio.to_thread(shutil.rmtree, self._home, True)
        self._on_close(self._id)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self._id} is closed")


async def _wait_all(proc: asyncio.subprocess.Process, pumps: asyncio.Future[Any]) -> None:
    await pumps
    await proc.wait()


def _as_bytes(content: FileContent) -> bytes:
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, bytes | bytearray):
        return bytes(content)
    raise SandboxError(f"sandbox file content must be str or bytes, got {type(content).__name__}")


def _signal_of(returncode: int | None) -> int | None:
    """The signal that ended the command: a negative return code, or a shell's 128+N."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if 128 < returncode <= 128 + 64:
        return returncode - 128
    return None


def _result(
    returncode: int | None,
    out: bytes,
    err: bytes,
    truncated: bool,
    elapsed: float,
    stopped: ExecReason | None,
) -> ExecResult:
    sig = _signal_of(returncode)
    if stopped is not None:
        reason = stopped
    elif sig == signal.SIGXCPU:
        reason = ExecReason.CPU_LIMIT
    elif sig == signal.SIGXFSZ:
        reason = ExecReason.FILE_SIZE
    elif returncode != 0 and _OOM_MARKERS.search(err):
        reason = ExecReason.OOM
    elif sig == signal.SIGKILL or (returncode is not None and returncode < 0):
        reason = ExecReason.KILLED
    else:
        reason = ExecReason.OK
    exit_code = None if stopped is not None or (returncode is not None and returncode < 0) else returncode
    return ExecResult(
        exit_code=exit_code,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        truncated=truncated,
        wall_s=elapsed,
        reason=reason,
        signal=sig if stopped is None else signal.SIGKILL,
    )
