"""File access inside a sandbox root that cannot be led out of it.

A checked-then-opened path is a race: the sandboxed command can swap a directory for a symlink
between the check and the open. So paths are never resolved as strings; each component is opened
relative to its parent's descriptor with ``O_NOFOLLOW``, which refuses every symlink on the way
(even one pointing inside the root: the sandbox's own symlinks are the sandbox's business, the
host reading through them is not).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from miles_envs.sandbox.base import PathEscapeError, SandboxError, check_relative

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _parent_fd(
    root: Path, parts: tuple[str, ...], create: bool, owner: tuple[int, int] | None = None
) -> Iterator[int]:
    """A descriptor of the directory holding the last of ``parts``, walked without following symlinks."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            if part == ".":
                continue
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                if owner is not None:  # a directory made for the sandbox belongs to its user
                    os.fchown(child, *owner)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PathEscapeError(
                        f"sandbox path component {part!r} is a symlink or not a directory"
                    ) from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def read_bytes(root: Path, path: str) -> bytes:
    parts = check_relative(path).parts
    with _parent_fd(root, parts, create=False) as parent:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=parent)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise PathEscapeError(f"sandbox path {path!r} is a symlink; refusing to follow it") from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a FIFO or device would block or leak
                raise SandboxError(f"sandbox path {path!r} is not a regular file")
            return f.read()


def write_bytes(root: Path, path: str, content: bytes, owner: tuple[int, int] | None) -> None:
    """Write ``content`` to ``path`` (parents made); ``owner`` (uid, gid) for what is created, when set."""
    parts = check_relative(path).parts
    with _parent_fd(root, parts, create=True, owner=owner) as parent:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(parts[-1], flags, 0o644, dir_fd=parent)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise PathEscapeError(f"sandbox path {path!r} is a symlink; refusing to follow it") from None
            raise
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SandboxError(f"sandbox path {path!r} is not a regular file")
            f.write(content)
            if owner is not None:
                os.fchown(f.fileno(), *owner)


def empty_dir(root: Path) -> None:
    """Remove everything inside ``root`` (symlinks removed, never followed)."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
