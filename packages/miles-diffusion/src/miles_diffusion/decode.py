"""Decode workers: the processes that unpack a streamed answer's frames, off the client's event loop.

A frame arrives as raw bytes in a shared-memory buffer (``wire.FrameReader``); a worker process
parses its header, checks every tensor's dtype, shape and byte range, and returns the tensors as
views of that buffer (``wire.unpack_frame``). Only the buffer's handle crosses between the processes
(torch's shared-memory pickling, between this host's own processes; nothing from the network is
ever unpickled), so the event loop neither parses nor copies, and several frames are unpacked at
once without the GIL in the way.

Workers are started with ``spawn`` (the client process has threads: forking it is unsafe) and
import only torch, numpy and the wire format, never diffusers. One pool per worker count serves the
whole process (every rollout and run in it); it starts on first use and stops at exit
(concurrent.futures joins its workers then).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

from miles_diffusion.wire import Microgroup, unpack_frame


class DecodeWorkerError(RuntimeError):
    """A decode worker process died (not the frame's fault: the pool is rebuilt on next use)."""


def _init_worker() -> None:
    torch.set_num_threads(1)  # parsing needs no intra-op threads; the engine and trainer want the cores


def _ready() -> bool:
    return True


class DecodePool:
    """``workers`` decode processes; :meth:`decode` unpacks one frame in one of them."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a decode pool needs at least one worker, got {workers}")
        self.workers = workers
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker
                )
            return self._pool

    def start(self) -> None:
        """Start every worker now (each imports torch: seconds) rather than on the first frames."""
        pool = self._executor()
        for future in [pool.submit(_ready) for _ in range(self.workers)]:
            future.result()

    async def decode(self, frame: torch.Tensor) -> Microgroup:
        """The microgroup in ``frame`` (a uint8 tensor from ``FrameReader(shared=True)``)."""
        pool = self._executor()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, unpack_frame, frame)
        except BrokenProcessPool as exc:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise DecodeWorkerError(f"a decode worker process died while unpacking a frame: {exc}") from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


_POOLS: dict[int, DecodePool] = {}
_POOLS_LOCK = threading.Lock()


def decode_pool(workers: int) -> DecodePool:
    """The process's pool of ``workers`` decode workers (made on first use)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = DecodePool(workers)
        return pool


def close_decode_pools() -> None:
    """Stop every decode pool of this process (at exit concurrent.futures stops them itself)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()
