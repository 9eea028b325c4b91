"""How the local provider isolates a command: Linux namespaces through util-linux, or nothing.

Each command runs in fresh user, network, PID, mount, IPC and UTS namespaces (``unshare``).
Inside, a short shell script (``_SETUP``) builds a new root on a tmpfs: the host's system
directories (``/usr``, ``/etc``, ...) bind-mounted read-only, the sandbox's directory at the
work directory, a private size-limited ``/tmp``, a few device nodes and a fresh ``/proc``; it
``pivot_root``s into it and detaches the host's root, so no path leads back to host files.
Then it applies the rlimits (``prlimit``), drops every capability and sets no-new-privs
(``setpriv``) and runs the command. The command is PID 1 of its PID namespace: when it exits or
is killed, the kernel kills everything it started, so nothing outlives an exec.

The network namespace holds only a loopback interface that is down: no address, host or
other sandbox is reachable. When the provider runs as root, the namespace's root is mapped to an
unprivileged host uid (``setpriv --reuid``), so even a hole in the mount setup meets ordinary
file permissions, never root's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from miles_envs.sandbox.base import IsolationReport, IsolationUnavailableError, SandboxLimits

# Run by /bin/sh as PID 1 of the new namespaces. $1 new-root mount point, $2 the sandbox
# directory, $3 the work directory inside, $4 /tmp size, $5 a per-exec nonce, $6 the skeleton root,
# $7 the host's system directories to bind; then the command's argv. A failing step prints the
# nonce, so a setup failure (the sandbox's fault) is never taken for the command's own exit status,
# and the command cannot fake one (the nonce is gone from its argv).
#
# The skeleton (built once per provider, see ``build_skeleton``) already holds the symlinks, empty
# mount points and device placeholders, so an exec spends its time on mounts, not on mkdir/ln.
_SETUP = r"""
set -eu
R="$1"; WS="$2"; WD="$3"; TMP="$4"; NONCE="$5"; SKEL="$6"; SYSDIRS="$7"; shift 7
trap 'echo "miles-sandbox-setup-failed $NONCE" >&2' EXIT
mount --bind "$SKEL" "$R"
for d in $SYSDIRS; do mount --rbind "/$d" "$R/$d"; mount -o remount,bind,ro,nosuid,nodev "$R/$d"; done
mount --bind "$WS" "$R$WD"
mount -o remount,bind,nosuid,nodev "$R$WD"
mount -t tmpfs -o "size=$TMP,mode=1777,nosuid,nodev" miles-tmp "$R/tmp"
for n in null zero full random urandom; do mount --bind "/dev/$n" "$R/dev/$n"; done
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
cd "$R"; pivot_root . .oldroot; umount -l /.oldroot
mount -o remount,bind,ro /
cd "$WD"
trap - EXIT
exec "$@"
"""

# Host entries a command needs to run ordinary programs; symlinks among them (merged /usr) are
# copied as symlinks, directories are bind-mounted read-only.
SYSTEM_ENTRIES = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
RESERVED = (*SYSTEM_ENTRIES, "tmp", "dev", "proc", ".oldroot")


def build_skeleton(skeleton: Path, workdir: str) -> list[str]:
    """Lay out the new root's fixed part in ``skeleton``; returns the system directories to bind."""
    os.chmod(skeleton, 0o755)
    to_bind = []
    for name in SYSTEM_ENTRIES:
        host = Path("/") / name
        if host.is_symlink():
            (skeleton / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (skeleton / name).mkdir()
            to_bind.append(name)
    for name in ("tmp", "proc", ".oldroot", "dev"):
        (skeleton / name).mkdir()
    for name in DEVICES:
        (skeleton / "dev" / name).touch()
    (skeleton / "dev" / "fd").symlink_to("/proc/self/fd")
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        (skeleton / "dev" / name).symlink_to(f"fd/{fd}")
    (skeleton / workdir.lstrip("/")).mkdir(parents=True)
    return to_bind


_TOOLS = ("unshare", "setpriv", "prlimit", "mount", "pivot_root", "timeout")
BACKSTOP_GRACE_S = 2.0
NAMESPACES = ("user", "net", "pid", "mount", "ipc", "uts")


@dataclass(frozen=True)
class Launcher:
    """Builds the argv that runs one command under the chosen isolation."""

    kind: str  # "namespaces" or "none"
    workdir: str  # where the sandbox directory appears to the command (namespaces only)
    host_uid: int | None  # the unprivileged uid commands run as when the provider is root
    skeleton: Path | None = None  # the new root's fixed layout (namespaces only)
    system_dirs: tuple[str, ...] = ()  # host directories bind-mounted read-only into it

    def argv(
        self,
        command: str,
        sandbox_dir: Path,
        mount_point: Path,
        limits: SandboxLimits,
        nonce: str = "probe",
        wall_s: float | None = None,
    ) -> list[str]:
        inner = [*rlimit_argv(limits), "--", *_drop_privileges(), "/bin/sh", "-c", command]
        # A backstop for when miles itself dies mid-exec (nobody left to enforce the wall clock):
        # coreutils timeout kills its process group a little after the wall clock.
        backstop = ["timeout", "--signal=KILL", f"{(wall_s or limits.wall_s) + BACKSTOP_GRACE_S:.3f}"]
        if self.kind == "none":
            return [*backstop, *inner]
        outer: list[str] = [*backstop]
        if self.host_uid is not None:
            outer += [
                "setpriv",
                f"--reuid={self.host_uid}",
                f"--regid={self.host_uid}",
                "--clear-groups",
                "--",
            ]
        return [
            *outer,
            "unshare",
            "--user",
            "--map-root-user",
            *(f"--{ns}" for ns in NAMESPACES if ns != "user"),
            "--fork",
            "--kill-child",  # unshare killed (our timeout) -> its child, PID 1, killed -> the namespace empties
            "--",
            "/bin/sh",
            "-c",
            _SETUP,
            "miles-sandbox",
            str(mount_point),
            str(sandbox_dir),
            self.workdir,
            str(limits.tmp_bytes),
            nonce,
            str(self.skeleton),
            " ".join(self.system_dirs),
            *inner,
        ]

    @property
    def owner(self) -> tuple[int, int] | None:
        """Who must own the sandbox directory so the command can write it."""
        return (self.host_uid, self.host_uid) if self.host_uid is not None else None


def rlimit_argv(limits: SandboxLimits) -> list[str]:
    """``prlimit`` applying the per-process limits. RLIMIT_NPROC counts per user namespace on Linux
    5.14+, so inside a fresh one it counts only this command's processes."""
    return [
        "prlimit",
        f"--as={limits.memory_bytes}",
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",  # soft: SIGXCPU; hard a second later: SIGKILL
        f"--nproc={limits.processes}",
        f"--fsize={limits.file_size_bytes}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]


def _drop_privileges() -> list[str]:
    return ["setpriv", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--"]


def setup_failure(stderr: bytes, nonce: str) -> str | None:
    """The setup's error output when the namespace setup (not the command) failed, else None."""
    marker = f"miles-sandbox-setup-failed {nonce}".encode()
    if marker not in stderr:
        return None
    return stderr.replace(marker, b"").decode("utf-8", "replace").strip()[-600:]


def check_reachable(path: Path, uid: int) -> None:
    """Refuse a base directory the unprivileged sandbox uid cannot traverse (a 0700 parent)."""
    for parent in [path, *path.parents]:
        mode = parent.stat()
        if parent.stat().st_uid != uid and not mode.st_mode & 0o001:
            raise IsolationUnavailableError(
                f"sandbox base directory {path} is not reachable by the sandbox uid {uid}: {parent} has mode "
                f"{oct(mode.st_mode & 0o777)} (others need 'x'); choose a base_dir under a world-traversable directory"
            )


def detect(requested: str, workdir: str, sandbox_uid: int, base: Path) -> tuple[Launcher, IsolationReport]:
    """The launcher for ``requested`` ("auto", "namespaces" or "none"), probed by running a real command.

    ``base`` is the provider's (empty, reachable) directory: the skeleton root and the probe go there.

    ``auto`` and ``namespaces`` both refuse to start when namespaces do not work: running
    untrusted commands unisolated must be asked for by name (``none``).
    """
    if requested == "none":
        missing = [t for t in ("prlimit", "setpriv", "timeout") if shutil.which(t) is None]
        if missing:
            raise IsolationUnavailableError(
                f"isolation 'none' still needs {', '.join(missing)} (util-linux, coreutils) on PATH"
            )
        launcher = Launcher("none", workdir, None)
        return launcher, IsolationReport(
            kind="none",
            detail="isolation: none (asked for by the recipe): commands run as this user with rlimits only; "
            "they can reach the network and every file this user can",
            blocks_network=False,
            hides_host_files=False,
            kills_process_tree=False,
        )
    if requested not in ("auto", "namespaces"):
        raise ValueError(f"isolation must be 'auto', 'namespaces' or 'none', got {requested!r}")
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        raise IsolationUnavailableError(
            f"sandbox isolation with Linux namespaces needs {', '.join(missing)} (util-linux, coreutils) on PATH; "
            "install util-linux, or set isolation: none to run commands unisolated"
        )
    host_uid = sandbox_uid if os.geteuid() == 0 else None
    skeleton = base / "skeleton"
    skeleton.mkdir()
    system_dirs = build_skeleton(skeleton, workdir)
    launcher = Launcher("namespaces", workdir, host_uid, skeleton, tuple(system_dirs))
    problem = _probe(launcher, base)
    if problem is not None:
        raise IsolationUnavailableError(
            f"sandbox isolation with Linux namespaces does not work on this machine: {problem}. "
            "User namespaces may be disabled (sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces, "
            "or a container without them); set isolation: none to run commands unisolated"
        )
    as_user = f"host uid {host_uid}" if host_uid is not None else f"host uid {os.geteuid()} (this user)"
    return launcher, IsolationReport(
        kind="namespaces",
        detail=f"isolation: Linux namespaces ({', '.join(NAMESPACES)}) via unshare, pivot_root into a private root, "
        f"capabilities dropped, commands as {as_user}",
        blocks_network=True,
        hides_host_files=True,
        kills_process_tree=True,
        extra={"namespaces": NAMESPACES, "host_uid": host_uid if host_uid is not None else os.geteuid()},
    )


def _probe(launcher: Launcher, base_dir: Path) -> str | None:
    """Run one command the way every exec will; None when it worked, else what went wrong."""
    with tempfile.TemporaryDirectory(prefix="probe-", dir=base_dir) as tmp:
        base = Path(tmp)
        os.chmod(base, 0o711)
        ws, mnt = base / "root", base / "mnt"
        ws.mkdir()
        mnt.mkdir()
        if launcher.owner is not None:
            os.chown(ws, *launcher.owner)
        # The probe checks what the sandbox promises: the host root is gone and the network is down.
        check = 'test -z "$(ls -A /.oldroot)" && cat /proc/net/dev | tail -n +3 | wc -l'
        argv = launcher.argv(check, ws, mnt, SandboxLimits())
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=20, env=clean_env({}, ""))
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{type(err).__name__}: {err}"
        if done.returncode != 0:
            return f"exit {done.returncode}: {done.stderr.strip()[-400:]}"
        if done.stdout.strip() != "1":  # only 'lo'
            return f"the network namespace has interfaces other than lo: {done.stdout.strip()!r}"
    return None


def clean_env(extra: Mapping[str, str], marker: str) -> dict[str, str]:
    """The environment a command starts with: nothing of the host's but a plain PATH and locale."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "LANG": "C.UTF-8",
        "HOME": "/tmp",
        "MILES_SANDBOX": marker,
    }
    env.update(extra)
    return env


def environ_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def pids_with_marker(marker: str, exclude: Sequence[int] = ()) -> list[int]:
    """Processes whose environment carries ``MILES_SANDBOX=marker`` (the unisolated mode's sweep)."""
    needle = f"MILES_SANDBOX={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in exclude and environ_has(int(name), needle):
            found.append(int(name))
    return found
