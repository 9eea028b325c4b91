"""The shared bucketed pipeline: group a stream of named tensors into buckets of bounded size.

Engines are called once per bucket, not once per tensor (a model has thousands).
A bucket is flushed when the next tensor would push it past the limit; a tensor
larger than the limit travels alone in its own bucket. One tensor of look-ahead
tells which bucket is the last without holding a second bucket in memory: only
the last bucket carries the new weight version (and asks engines to flush their
cache), so an engine reports a version only once all of its tensors have arrived.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles.errors import ConfigError
from miles.interfaces import TransportStats

if TYPE_CHECKING:
    import torch

MiB = 1024 * 1024


@dataclass
class Bucket:
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0
    index: int = 0  # position in this update, from 0
    last: bool = False  # no bucket follows in this update

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tensors]


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be positive, got {bucket_bytes} bytes")
    it = iter(named_tensors)
    current = Bucket()
    item = next(it, None)
    while item is not None:
        size = tensor_nbytes(item[1])
        if current.tensors and current.nbytes + size > bucket_bytes:
            yield current
            current = Bucket(index=current.index + 1)
        current.tensors.append(item)
        current.nbytes += size
        item = next(it, None)
    if current.tensors:
        current.last = True
        yield current


class BucketedTransport(abc.ABC):
    """Base of the transports: every rank drains the stream; rank 0 sends it bucket by bucket.

    Subclasses implement ``_open`` (rank 0, once), ``_send_bucket`` and ``_close``,
    and say where a tensor must live before sending (``_target_device``).
    """

    def __init__(self, bucket_mb: float = 512, dtype: str | None = None) -> None:
        if bucket_mb <= 0:
            raise ConfigError(f"transport option bucket_mb must be > 0, got {bucket_mb}")
        if dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"transport option dtype must be float32, bfloat16, float16 or null, got {dtype!r}"
            )
        self.bucket_bytes = int(bucket_mb * MiB)
        self.dtype_name = dtype
        self.rank = -1
        self.world_size = 0
        self.device = "cpu"
        self.engine_urls: list[str] = []

    # -------------------------------------------------------- Transport API

    def connect(self, engine_urls: list[str], *, rank: int, world_size: int, device: str) -> None:
        self.engine_urls = list(engine_urls)
        self.rank, self.world_size, self.device = rank, world_size, device
        if rank == 0 and self.engine_urls:
            self._open()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> TransportStats:
        if self.rank < 0:
            raise RuntimeError(f"{type(self).__name__}.send called before connect")
        t0 = time.perf_counter()
        if self.rank != 0 or not self.engine_urls:
            # Producing the stream is a collective on the trainer ranks (shards are gathered),
            # so every rank must consume it even though only rank 0 talks to engines.
            for _ in named_tensors:
                pass
            return TransportStats(bytes_sent=0, seconds=time.perf_counter() - t0, buckets=0, version=version)
        sent = 0
        buckets = 0
        stream = iter(named_tensors)
        try:
            for bucket in iter_buckets(self._prepared(stream), self.bucket_bytes):
                self._send_bucket(bucket, version)
                sent += bucket.nbytes
                buckets += 1
        except Exception:
            # Keep step with the other trainer ranks (they are gathering the rest of the stream),
            # so a refused update fails this call without leaving anyone stuck in a collective.
            for _ in stream:
                pass
            raise
        if buckets == 0:
            raise RuntimeError(f"{type(self).__name__}: no tensors to send for weight version {version}")
        return TransportStats(
            bytes_sent=sent, seconds=time.perf_counter() - t0, buckets=buckets, version=version
        )

    def close(self) -> None:
        if self.rank == 0 and self.engine_urls:
            self._close()
        self.engine_urls = []

    # ------------------------------------------------------------ subclass

    @abc.abstractmethod
    def _open(self) -> None:
        """Rank 0, once: connect to the engines (join a group, create a hand-off directory...)."""

    @abc.abstractmethod
    def _send_bucket(self, bucket: Bucket, version: int) -> None:
        """Rank 0: deliver one bucket to every engine (one engine call per bucket)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Rank 0: release what ``_open`` acquired."""

    def _target_device(self) -> str:
        return "cpu"

    # ------------------------------------------------------------- helpers

    def _prepared(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        dtype = getattr(torch, self.dtype_name) if self.dtype_name else None
        device = self._target_device()
        for name, tensor in named_tensors:
            t = tensor.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            yield name, t.to(device).contiguous()
