"""Move a trainer's device state out and back, storage by storage: to host memory or to disk.

Megatron keeps gradients (and, with the distributed optimizer, parameters) as views into
contiguous buffers, so moving tensors one by one would break the views. Instead each distinct
storage behind the given tensors is copied out whole and then resized to zero bytes; onload
resizes it back and copies the bytes in. Every view stays valid and every value comes back
bit for bit. Nothing may use the tensors in between.

Two targets:

- host (:class:`StorageOffloader` alone): one host copy per storage (pinned on CUDA), so the
  host holds the whole state;
- disk (:class:`DiskSpill`): each storage streamed to its own file in a fresh directory on
  node-local disk through ONE reusable staging buffer of a fixed size (pinned on CUDA), chunk by
  chunk, and read back the same way, so the process's host memory for the state is the staging
  buffer whatever the model's size. The files (and the directory, which the spill created) are
  removed at onload; nothing else on the disk is touched.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import time
from collections.abc import Iterable

import torch

from miles_megatron.config import directory_problem

log = logging.getLogger(__name__)

SPILL_PREFIX = "miles-megatron-offload-"


class DiskSpill:
    """Storages to files under ``directory`` through one staging buffer of ``staging_bytes``.

    The staging buffer is allocated on first use and reused for every chunk of every storage,
    offload after offload. Each offload writes into a directory it creates (``mkdtemp`` under
    ``directory``); onload removes exactly the files it wrote and then that directory.
    """

    def __init__(self, directory: str | None, staging_bytes: int, key: str = "megatron.offload_dir") -> None:
        if staging_bytes < 1:
            raise ValueError(f"staging buffer must be at least 1 byte, got {staging_bytes}")
        self.parent = directory if directory is not None else tempfile.gettempdir()
        problem = directory_problem(self.parent, key)
        if problem is not None:
            raise ValueError(problem)
        self.staging_bytes = staging_bytes
        self.staging: torch.Tensor | None = None
        self.directory: str | None = None  # the one this spill created, while offloaded
        self.files: list[str] = []

    def _buffer(self, pin: bool) -> torch.Tensor:
        if self.staging is None:
            self.staging = torch.empty(self.staging_bytes, dtype=torch.uint8, pin_memory=pin)
        return self.staging

    def write(self, storages: list[torch.UntypedStorage], device: torch.device) -> int:
        """Every storage into its own file, chunk by chunk; returns the bytes written. On failure the
        files written so far are removed and the storages are untouched."""
        if self.directory is not None:
            raise RuntimeError("already offloaded")
        staging = self._buffer(device.type == "cuda")
        host = staging.numpy().data  # the same memory, as a memoryview for file I/O
        self.directory = tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=self.parent)
        written = 0
        try:
            for i, s in enumerate(storages):
                path = os.path.join(self.directory, f"storage-{i:05d}.bin")
                self.files.append(path)
                view = torch.empty(0, dtype=torch.uint8, device=device).set_(s)
                with open(path, "wb", buffering=0) as f:
                    for start in range(0, s.nbytes(), self.staging_bytes):
                        n = min(self.staging_bytes, s.nbytes() - start)
                        # A blocking copy: the buffer is overwritten by the next chunk.
                        staging[:n].copy_(view[start : start + n])
                        _write_all(f, host[:n])
                        written += n
        except BaseException:
            self.remove()
            raise
        return written

    def read(self, storages: list[torch.UntypedStorage], sizes: list[int], device: torch.device) -> int:
        """Resize every storage back to its size and fill it from its file; then remove the files."""
        if self.directory is None:
            raise RuntimeError("not offloaded")
        staging = self._buffer(device.type == "cuda")
        host = staging.numpy().data
        read = 0
        for s, size, path in zip(storages, sizes, self.files, strict=True):
            s.resize_(size)
            view = torch.empty(0, dtype=torch.uint8, device=device).set_(s)
            with open(path, "rb", buffering=0) as f:
                for start in range(0, size, self.staging_bytes):
                    n = min(self.staging_bytes, size - start)
                    _read_all(f, host[:n])
                    view[start : start + n].copy_(staging[:n])
                    read += n
        self.remove()
        return read

    def remove(self) -> None:
        """Remove the files this spill wrote and the directory it created (only those)."""
        for path in self.files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        self.files = []
        if self.directory is not None:
            try:
                os.rmdir(self.directory)
            except OSError as exc:  # something else put files there: leave them
                log.warning("megatron offload: could not remove %s: %s", self.directory, exc)
            self.directory = None


def _write_all(f: io.FileIO, data: memoryview) -> None:
    while data:  # an unbuffered write may take part of the chunk
        n = f.write(data) or 0
        data = data[n:]


def _read_all(f: io.FileIO, out: memoryview) -> None:
    while out:
        n = f.readinto(out)
        if not n:
            raise OSError("megatron offload: a spilled file is shorter than the storage it holds")
        out = out[n:]


class StorageOffloader:
    """Offload / onload of the storages behind ``tensors`` (those on ``device`` only).

    ``disk`` None: to host memory (pinned on CUDA); else through that :class:`DiskSpill`.
    """

    def __init__(
        self, tensors: Iterable[torch.Tensor], device: torch.device | str, disk: DiskSpill | None = None
    ) -> None:
        device = torch.device(device)
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t is None or t.device.type != device.type:
                continue
            s = t.untyped_storage()
            if s.nbytes() > 0:
                seen.setdefault(s.data_ptr(), s)
        self.storages = list(seen.values())
        self.device = device
        self.disk = disk
        self._host: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self._offloaded = False

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def offload(self) -> dict[str, float]:
        if self._offloaded:
            raise RuntimeError("already offloaded")
        t0 = time.perf_counter()
        pin = self.device.type == "cuda"
        sizes = [s.nbytes() for s in self.storages]
        if self.disk is not None:
            moved = self.disk.write(self.storages, self.device)
        else:
            moved = 0
            for s in self.storages:
                view = torch.empty(0, dtype=torch.uint8, device=self.device).set_(s)
                host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(view)
                self._host.append(host)
                moved += s.nbytes()
        if pin:
            torch.cuda.synchronize(self.device)
        for s in self.storages:
            s.resize_(0)
        self._sizes = sizes
        self._offloaded = True
        if pin:
            torch.cuda.empty_cache()
        out = {"bytes": float(moved), "seconds": time.perf_counter() - t0}
        if self.disk is not None:
            out["staging_bytes"] = float(self.disk.staging_bytes)
        return out

    def onload(self) -> dict[str, float]:
        if not self._offloaded:
            raise RuntimeError("not offloaded")
        t0 = time.perf_counter()
        if self.disk is not None:
            moved = self.disk.read(self.storages, self._sizes, self.device)
        else:
            moved = 0
            for s, host in zip(self.storages, self._host, strict=True):
                s.resize_(host.numel())
                torch.empty(0, dtype=torch.uint8, device=self.device).set_(s).copy_(host, non_blocking=True)
                moved += host.numel()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._host = []
        self._sizes = []
        self._offloaded = False
        return {"bytes": float(moved), "seconds": time.perf_counter() - t0}
