"""Publishing deltas to a directory (trainer side) and verifying and decoding them (engine side).

Layout::

    ROOT/v000007/data-00000.bin    compressed payloads, back to back (a new file past ``max_file_bytes``)
    ROOT/v000007/index.json        written last: the version exists for readers iff this file does

Every file is written as ``NAME.tmp`` in the same directory, flushed, fsynced and
renamed over ``NAME``; the directory is fsynced after the data files and again after
the index, so after a crash a visible index implies durable data files.

One writer per ``ROOT``. Readers never write.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from miles_transports.weight_delta import codec
from miles_transports.weight_delta.codec import DeltaError
from miles_transports.weight_delta.index import INDEX_NAME, DeltaIndex, Payload, TensorEntry

_VERSION_DIR = re.compile(r"v(\d{6,})")
DATA_FILE = "data-{:05d}.bin"


def version_dir(root: str | os.PathLike[str], version: int) -> Path:
    """``ROOT/v{version:06d}``."""
    return Path(root) / f"v{version:06d}"


def published_versions(root: str | os.PathLike[str]) -> list[int]:
    """Versions under ``root`` whose index exists (complete publishes), ascending."""
    found = []
    for entry in Path(root).iterdir() if Path(root).is_dir() else ():
        m = _VERSION_DIR.fullmatch(entry.name)
        if m and (entry / INDEX_NAME).is_file():
            found.append(int(m.group(1)))
    return sorted(found)


# ------------------------------------------------------------------ atomic files


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        # Some shared filesystems refuse fsync on a directory; their renames cannot be forced from here.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


class _AtomicFile:
    """``path.tmp`` opened for writing; ``commit`` makes it ``path`` (flush, fsync, rename), ``abort`` drops it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.file: BinaryIO = open(self.tmp, "xb")  # noqa: SIM115 - closed by commit/abort
        self.size = 0

    def write(self, data: bytes) -> int:
        offset = self.size
        self.file.write(data)
        self.size += len(data)
        return offset

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------ writer


@dataclass
class PublishStats:
    version: int
    base_version: int
    path: str  # the version directory
    tensors: int
    tensors_changed: int
    total_bytes: int  # bytes of all tensors
    changed_bytes: int  # bytes that differ from the base
    file_bytes: int  # bytes written to disk (data files and index)
    seconds: float

    @property
    def density(self) -> float:
        """Fraction of the state's bytes that changed."""
        return self.changed_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass
class _Base:
    """One tensor as the engines hold it: its bytes (the writer's own copy) and their digest."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, owned by the snapshot
    digest: str


class DeltaWriter:
    """Publishes each new state as a delta against a byte snapshot of what the engines hold.

    ``seed`` records the base (one copy of the model in host memory). ``publish``
    streams the new state: per tensor it computes the delta against the snapshot,
    compresses and appends it to a data file, and moves the snapshot forward, so it
    never holds more than one new tensor at a time. Unchanged tensors write nothing
    but are still listed (with their digest) in the index.

    Memory beyond the snapshot: the tensor being encoded, scratch buffers sized for
    the largest tensor, and an undo log (the changed-element bitmap and old bytes of
    each changed tensor, i.e. about the size of the delta before compression).

    A publish that fails part-way (bad input, a failing producer, a full disk) is
    rolled back: its directory is removed and the snapshot restored from the undo
    log, so the writer stays on the last published version and the caller may retry.
    After a successful publish, version directories other than the ``keep`` newest
    are removed (never the new one or its base).

    Every publish must list the whole state: a tensor missing from the stream, one
    the seed did not have, or one whose dtype or shape differs from the snapshot's is
    refused (engines load deltas into the tensors they hold, so the set of tensors,
    their dtypes and shapes are fixed at seed; re-seed to change them).

    One writer per root, not thread-safe.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        encoding: str = "xor",
        level: int = 1,
        digest: str = "xxh3_128",
        keep: int = 3,
        max_file_bytes: int = 2**31,
        threads: int = 0,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise DeltaError(
                f"keep must be an integer >= 1 (the number of version directories kept), got {keep!r}"
            )
        if max_file_bytes < 1:
            raise DeltaError(f"max_file_bytes must be >= 1, got {max_file_bytes!r}")
        self.root = Path(root)
        self.encoding = encoding
        self.digest = codec.digest_algorithm(digest)
        self.keep = keep
        self.max_file_bytes = max_file_bytes
        self._encoder = codec.Encoder(encoding)
        self._compressor = codec.Compressor(level, threads)
        self._snapshot: dict[str, _Base] = {}
        self._version: int | None = None  # the version the snapshot holds

    @property
    def version(self) -> int | None:
        """The version the engines are expected to hold (the last seeded or published one)."""
        return self._version

    def seed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Record the state the engines hold now, as ``version``. Replaces any earlier snapshot."""
        _check_version(version, "seed version")
        snapshot: dict[str, _Base] = {}
        for name, t in named_tensors:
            if name in snapshot:
                raise DeltaError(f"tensor name appears twice in the seed (version {version})", tensor=name)
            _check_dtype(t, name)
            data = np.array(codec.tensor_bytes(t), copy=True)
            snapshot[name] = _Base(t.dtype, tuple(t.shape), data, self.digest.hexdigest(data))
        self._snapshot, self._version = snapshot, version

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishStats:
        """Write ``ROOT/v{version:06d}`` with the delta of ``named_tensors`` against the snapshot."""
        start = time.perf_counter()
        if self._version is None:
            raise DeltaError("publish before seed: call seed() with the weights the engines hold first")
        _check_version(version, "publish version")
        if version <= self._version:
            raise DeltaError(f"version {version} must be greater than the current version {self._version}")
        vdir = version_dir(self.root, version)
        if (vdir / INDEX_NAME).exists():
            raise DeltaError("this version is already published", path=vdir)
        if vdir.exists():  # left by a publish that crashed before its index: never visible to readers
            shutil.rmtree(vdir)
        vdir.mkdir(parents=True)
        _fsync_dir(vdir.parent)

        run = _Publish(self, vdir, version)
        try:
            index = run.write(named_tensors)
        except BaseException:
            run.rollback()
            raise
        # The index is in place: readers may apply this version from now on, whatever happens next.
        self._version = version
        _fsync_dir(vdir)
        self._prune(version, index.base_version)
        return PublishStats(
            version=version,
            base_version=index.base_version,
            path=str(vdir),
            tensors=len(index.tensors),
            tensors_changed=run.tensors_changed,
            total_bytes=run.total_bytes,
            changed_bytes=run.changed_bytes,
            file_bytes=run.file_bytes,
            seconds=time.perf_counter() - start,
        )

    def _prune(self, version: int, base_version: int) -> None:
        """Remove version directories older than the ``keep`` newest, sparing ``version`` and its base."""
        older = sorted(
            int(m.group(1))
            for e in self.root.iterdir()
            if (m := _VERSION_DIR.fullmatch(e.name)) and e.is_dir() and int(m.group(1)) < version
        )
        spared = {base_version, *older[len(older) - (self.keep - 1) :]} if self.keep > 1 else {base_version}
        for v in older:
            if v not in spared:
                shutil.rmtree(version_dir(self.root, v), ignore_errors=True)


class _Publish:
    """One publish in progress: writes payloads, moves the snapshot, and can undo both."""

    def __init__(self, writer: DeltaWriter, vdir: Path, version: int) -> None:
        self.w = writer
        self.vdir = vdir
        self.version = version
        self.base_version = writer.version
        self.files: dict[str, int] = {}
        self.current: _AtomicFile | None = None
        self.undo: list[_Undo] = []
        self.tensors_changed = self.total_bytes = self.changed_bytes = self.file_bytes = 0

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> DeltaIndex:
        entries: dict[str, TensorEntry] = {}
        for name, t in named_tensors:
            if name in entries:
                raise DeltaError("tensor name appears twice in one publish", path=self.vdir, tensor=name)
            entries[name] = self.tensor(name, t)
            del t  # let it go before the producer makes the next one: one new tensor at a time
        missing = self.w._snapshot.keys() - entries.keys()
        if missing:
            shown = ", ".join(sorted(missing)[:5]) + (", ..." if len(missing) > 5 else "")
            raise DeltaError(
                f"{len(missing)} tensor(s) of the base were not published: {shown}; "
                "every publish must list the whole state",
                path=self.vdir,
            )
        self.finish_file()
        _fsync_dir(self.vdir)  # the data files' names are durable before the index can be
        index = DeltaIndex(
            version=self.version,
            base_version=self.base_version,  # type: ignore[arg-type]  # set: publish checks seed ran
            encoding=self.w.encoding,
            digest=self.w.digest.name,
            files=self.files,
            tensors=entries,
        )
        out = _AtomicFile(self.vdir / INDEX_NAME)
        try:
            out.write(index.to_json().encode())
            out.commit()
        except BaseException:
            out.abort()
            raise
        self.file_bytes += out.size
        return index

    def tensor(self, name: str, t: torch.Tensor) -> TensorEntry:
        base = self.w._snapshot.get(name)
        if base is None:
            raise DeltaError(
                "not in the base the engines hold (the set of tensors is fixed at seed)",
                path=self.vdir,
                tensor=name,
            )
        if t.dtype != base.dtype or tuple(t.shape) != base.shape:
            raise DeltaError(
                f"is {t.dtype} {list(t.shape)} but the base holds {base.dtype} {list(base.shape)}; "
                "a delta cannot change a tensor's dtype or shape",
                path=self.vdir,
                tensor=name,
            )
        new = codec.tensor_bytes(t)
        self.total_bytes += len(new)
        enc = self.w._encoder.encode(new, base.data, base.dtype.itemsize)
        if enc is None:
            return TensorEntry(base.dtype, base.shape, base.digest)
        compressed = self.w._compressor.compress(enc.payload)
        file_name, offset = self.append(compressed)
        digest = self.w.digest.hexdigest(new)
        payload = Payload(file_name, offset, len(compressed), len(enc.payload), base.digest)
        # Move the snapshot forward, recording how to move it back until the index is written.
        self.undo.append(_Undo(base, base.digest, enc.packed_mask, enc.old_values))
        np.copyto(base.data, new)
        base.digest = digest
        self.tensors_changed += 1
        self.changed_bytes += enc.changed_bytes
        return TensorEntry(base.dtype, base.shape, digest, payload)

    def append(self, data: bytes) -> tuple[str, int]:
        """Append one payload to the current data file (a new one past max_file_bytes); (file, offset)."""
        if (
            self.current is not None
            and self.current.size
            and self.current.size + len(data) > self.w.max_file_bytes
        ):
            self.finish_file()
        if self.current is None:
            self.current = _AtomicFile(self.vdir / DATA_FILE.format(len(self.files)))
            self.files[self.current.path.name] = 0
        offset = self.current.write(data)
        return self.current.path.name, offset

    def finish_file(self) -> None:
        if self.current is not None:
            self.current.commit()
            self.files[self.current.path.name] = self.current.size
            self.file_bytes += self.current.size
            self.current = None

    def rollback(self) -> None:
        """Undo a failed publish: drop the partial directory and restore the snapshot."""
        if self.current is not None:
            self.current.abort()
            self.current = None
        shutil.rmtree(self.vdir, ignore_errors=True)
        for u in reversed(self.undo):
            codec.revert(u.base.data, u.base.dtype.itemsize, u.packed_mask, u.old_values)
            u.base.digest = u.digest
        self.undo.clear()


@dataclass
class _Undo:
    """How to move one snapshot tensor back to the last published version."""

    base: _Base
    digest: str  # its digest before this publish
    packed_mask: np.ndarray  # which elements this publish changed ...
    old_values: np.ndarray  # ... and their bytes before it


def _check_version(version: object, what: str) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise DeltaError(f"{what} must be an integer >= 0, got {version!r}")


def _check_dtype(t: torch.Tensor, name: str) -> None:
    try:
        codec.dtype_name(t.dtype)
    except DeltaError as e:
        raise DeltaError(e.what, tensor=name) from None


# ------------------------------------------------------------------ reader


def read_index(root: str | os.PathLike[str], version: int) -> DeltaIndex:
    """The parsed, validated index of ``version`` (a DeltaError if it is not published or malformed)."""
    vdir = version_dir(root, version)
    path = vdir / INDEX_NAME
    try:
        if path.resolve(strict=True).parent != vdir.resolve(strict=True):
            raise DeltaError("index is a link that leads outside the version directory", path=path)
        text = path.read_bytes()
    except FileNotFoundError:
        if not vdir.is_dir():
            raise DeltaError(f"version {version} was not published (no such directory)", path=vdir) from None
        raise DeltaError(
            f"no {INDEX_NAME}: version {version} was not (fully) published; the writer writes the index last, "
            "after every data file",
            path=vdir,
        ) from None
    except OSError as e:
        raise DeltaError(f"cannot read the index ({e.strerror or e})", path=path) from None
    index = DeltaIndex.from_json(text, path)
    if index.version != version:
        raise DeltaError(f"index says version {index.version}, expected {version}", path=path)
    return index


def read_delta(
    root: str | os.PathLike[str],
    version: int,
    current: Mapping[str, torch.Tensor],
    current_version: int,
) -> dict[str, torch.Tensor]:
    """Verify ``ROOT/v{version:06d}`` against ``current`` and return the new values of the changed tensors.

    Nothing is returned unless everything checks out: the index exists and parses;
    its base version is ``current_version``; every data file is a plain file inside
    the version directory with the size the index records; every tensor of the
    index exists in ``current`` with the same dtype and shape; each changed tensor's
    bytes match the digest of the base its payload was computed against, and its
    payload decompresses to the declared length; and the digest of EVERY resulting
    tensor, changed or not, matches the index. Otherwise a DeltaError says what and
    where (version directory, file, tensor).

    ``current`` is not modified; the returned tensors are fresh CPU tensors, so the
    caller can swap them all in at once. Tensors of ``current`` the index does not
    list are ignored (e.g. engine-only buffers).

    Re-reading the same version over a partly applied state: an ``overwrite`` delta
    accepts a tensor that already holds its result (idempotent), an ``xor`` delta
    refuses it (applying it again would revert the tensor).
    """
    vdir = version_dir(root, version)
    index = read_index(root, version)
    if index.base_version != current_version:
        raise DeltaError(
            f"delta applies to version {index.base_version}, but this host holds version {current_version}",
            path=vdir,
        )
    for name, entry in index.tensors.items():
        held = current.get(name)
        if held is None:
            raise DeltaError("listed in the index but missing on this host", path=vdir, tensor=name)
        if held.dtype != entry.dtype or tuple(held.shape) != entry.shape:
            raise DeltaError(
                f"the index has {entry.dtype} {list(entry.shape)} but this host holds "
                f"{held.dtype} {list(held.shape)}",
                path=vdir,
                tensor=name,
            )

    hexdigest = codec.digest_algorithm(index.digest).hexdigest
    files = _open_data_files(vdir, index)
    try:
        out: dict[str, torch.Tensor] = {}
        for name, entry in index.tensors.items():
            held_bytes = codec.tensor_bytes(current[name])
            held_digest = hexdigest(held_bytes)
            if entry.payload is None:
                if held_digest != entry.digest:
                    raise DeltaError(
                        "unchanged in this delta, but this host's bytes differ from the writer's "
                        f"(digest {held_digest}, index {entry.digest}): the host is not on version "
                        f"{index.base_version}",
                        path=vdir,
                        tensor=name,
                    )
                continue
            p = entry.payload
            already_applied = held_digest == entry.digest
            if held_digest != p.base_digest and not (already_applied and index.encoding == "overwrite"):
                if already_applied:
                    raise DeltaError(
                        "this host already holds the result of this delta; an xor delta must be applied "
                        "exactly once",
                        path=vdir,
                        tensor=name,
                    )
                raise DeltaError(
                    f"this host's bytes (digest {held_digest}) are not the base the delta was computed "
                    f"against (digest {p.base_digest})",
                    path=vdir,
                    tensor=name,
                )
            out[name] = _decode(vdir, index.encoding, entry, files[p.file], held_bytes, hexdigest, name)
    finally:
        for f in files.values():
            os.close(f)
    return out


def _decode(
    vdir: Path,
    encoding: str,
    entry: TensorEntry,
    fd: int,
    held: np.ndarray,
    hexdigest: Callable[[object], str],
    name: str,
) -> torch.Tensor:
    p = entry.payload
    assert p is not None
    where = vdir / p.file
    data = os.pread(fd, p.length, p.offset)
    if len(data) != p.length:  # the file shrank after it was opened
        raise DeltaError(
            f"payload [{p.offset}, {p.offset + p.length}) is cut short: read {len(data)} bytes",
            path=where,
            tensor=name,
        )
    try:
        raw = np.frombuffer(codec.decompress(data, p.raw_length), dtype=np.uint8)
    except ValueError as e:
        raise DeltaError(f"payload at offset {p.offset}: {e}", path=where, tensor=name) from None
    result = torch.empty(entry.shape, dtype=entry.dtype)
    result_bytes = codec.tensor_bytes(result)
    try:
        codec.decode(encoding, held, raw, entry.dtype.itemsize, result_bytes)
    except ValueError as e:
        raise DeltaError(f"payload at offset {p.offset}: {e}", path=where, tensor=name) from None
    got = hexdigest(result_bytes)
    if got != entry.digest:
        raise DeltaError(
            f"the decoded tensor's digest {got} does not match the index ({entry.digest}): "
            "the payload or the index is corrupt",
            path=where,
            tensor=name,
        )
    return result


def _open_data_files(vdir: Path, index: DeltaIndex) -> dict[str, int]:
    """Open every data file of the index read-only, after checking it stays inside ``vdir``."""
    try:
        inside = vdir.resolve(strict=True)
    except OSError as e:
        raise DeltaError(f"cannot resolve the version directory ({e.strerror or e})", path=vdir) from None
    fds: dict[str, int] = {}
    try:
        for name, size in index.files.items():
            path = vdir / name
            # Names were checked to be plain at parse time; resolving also catches a symlink that leads out.
            try:
                resolved = path.resolve(strict=True)
            except FileNotFoundError:
                raise DeltaError("data file listed in the index is missing", path=path) from None
            except OSError as e:
                raise DeltaError(f"cannot resolve data file ({e.strerror or e})", path=path) from None
            if resolved.parent != inside:
                raise DeltaError(
                    f"data file resolves to {resolved}, outside the version directory {inside}", path=path
                )
            try:
                fd = os.open(resolved, os.O_RDONLY)
            except OSError as e:
                raise DeltaError(f"cannot open data file ({e.strerror or e})", path=path) from None
            fds[name] = fd
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise DeltaError("data file is not a regular file", path=path)
            if st.st_size != size:
                kind = "truncated" if st.st_size < size else "longer than written"
                raise DeltaError(
                    f"data file is {st.st_size} bytes, the index says {size} ({kind})", path=path
                )
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds
