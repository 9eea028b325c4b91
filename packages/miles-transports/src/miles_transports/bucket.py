"""The shared bucketed pipeline: group a stream of named tensors into buckets of bounded size.

Engines are called once per bucket, not once per tensor (a model has thousands).
A bucket is flushed when the next tensor would push it past the limit; a tensor
larger than the limit travels alone in its own bucket. One tensor of look-ahead
tells which bucket is the last without holding a second bucket in memory: only
the last bucket carries the new weight version (and asks engines to flush their
cache), so an engine reports a version only once all of its tensors have arrived.

Mixture-of-experts weights take a second pass: the producer yields every non-expert
tensor first, then the expert ones, and an expert tensor never shares a bucket with
a non-expert one. With expert parallelism of degree ``ep`` each expert tensor a rank
holds stands for ``ep`` gathered tensors at flush time, so it counts ``ep`` times
against the bucket limit.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles.interfaces import TransportStats
from miles_transports.fanout import EngineFanout
from miles_transports.weight_check import WeightEqualityCheck

if TYPE_CHECKING:
    import torch

MiB = 1024 * 1024


class TransportOptions(ComponentOptions):
    """The options every built-in transport takes (``weight_sync``: bucket_mb and the weight check)."""

    bucket_mb: float = Field(512, description="weights are sent in buckets of at most this many MiB")
    dtype: str | None = Field(None, description="dtype the engines hold (default: the engines' own)")
    check_equal: bool = Field(
        False, description="compare every engine tensor with the trainer's after the first update"
    )
    check_mode: Literal["exact", "rounded"] = Field(
        "exact", description="exact: bit-exact; rounded: cast to the engine dtype first"
    )
    check_skip: Sequence[str] = Field((), description="tensor names the check leaves out")


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


def is_expert_tensor(name: str) -> bool:
    """Hugging Face MoE naming: ``...mlp.experts.3.down_proj.weight`` or fused ``...mlp.experts.gate_up_proj``."""
    return ".experts." in name


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, expert_parallel: int = 1
) -> Iterator[Bucket]:
    """Group the stream into buckets of at most ``bucket_bytes`` (a bigger tensor travels alone).

    The pass changes (non-expert -> expert) flush the bucket; an expert tensor counts
    ``expert_parallel`` times against the limit. ``Bucket.nbytes`` is always the bytes
    actually held. A non-expert tensor after an expert one is an error: the producer
    must yield the two passes in order.
    """
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be positive, got {bucket_bytes} bytes")
    if expert_parallel < 1:
        raise ConfigError(f"expert_parallel must be >= 1, got {expert_parallel}")
    it = iter(named_tensors)
    current = Bucket()
    weighted = 0  # bytes counted against the limit
    expert_pass = False
    item = next(it, None)
    while item is not None:
        name, tensor = item
        expert = is_expert_tensor(name)
        if expert_pass and not expert:
            raise ValueError(
                f"weight stream: non-expert tensor {name!r} after expert tensors; yield every non-expert "
                "tensor first, then the experts (the expert pass)"
            )
        size = tensor_nbytes(tensor)
        cost = size * (expert_parallel if expert else 1)
        if current.tensors and (weighted + cost > bucket_bytes or expert != expert_pass):
            yield current
            current = Bucket(index=current.index + 1)
            weighted = 0
        expert_pass = expert
        current.tensors.append(item)
        current.nbytes += size
        weighted += cost
        item = next(it, None)
    if current.tensors:
        current.last = True
        yield current


class StreamTransport(abc.ABC):
    """Base of the transports: every rank drains the weight stream; the delivering rank(s) send it.

    It owns what every transport shares: the cast to the transport dtype, the opt-in
    weight-equality check around the first update, draining the rest of the stream when an
    update fails (the stream is a collective on the trainer ranks), and the stats.
    Subclasses implement ``_open`` (a delivering rank, once), ``_deliver`` and ``_close``,
    and say where a tensor must live before sending (``_target_device``). ``bucket_mb`` is
    the size limit of the bucketed subclasses; the others accept it so that one
    ``weight_sync`` section fits every transport.
    """

    # Whether the weight-equality check may randomise the engines before the first update.
    check_randomizes = True
    # Whether an update may carry only a LoRA adapter's tensors (``carry_adapter``); the engines
    # apply them to the adapter of that name, loaded by the trainer through /load_lora_adapter.
    carries_adapters = False

    def __init__(
        self,
        bucket_mb: float = 512,
        dtype: str | None = None,
        check_equal: bool = False,
        check_mode: str = "exact",
        check_skip: Sequence[str] = (),
    ) -> None:
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
        # The opt-in weight-equality check runs around the first update, and again around the first
        # update after the transport re-formed its engine connections (see ``_rearm_check``).
        self._check_settings = (check_mode, tuple(check_skip)) if check_equal else None
        self._check = WeightEqualityCheck(check_mode, check_skip) if check_equal else None  # type: ignore[arg-type]
        # Experts' share of the flush threshold (set by a backend with expert parallelism).
        self.expert_parallel = 1
        self.adapter: str | None = None

    def carry_adapter(self, name: str) -> None:
        """Updates carry only LoRA adapter ``name``'s tensors: the weight check randomises and compares
        that adapter's tensors on the engines, never the base (which the update does not send)."""
        if not self.carries_adapters:
            raise ConfigError(f"{type(self).__name__} cannot carry a LoRA adapter")
        self.adapter = name
        if self._check is not None:
            self._check.adapter = name

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
        if not self._delivers():
            # Producing the stream is a collective on the trainer ranks (shards are gathered),
            # so every rank must consume it even though only some (rank 0 by default) talk to engines.
            for _ in named_tensors:
                pass
            return TransportStats(bytes_sent=0, seconds=time.perf_counter() - t0, buckets=0, version=version)
        stream = iter(named_tensors)
        check, self._check = self._check, None
        engines: EngineFanout | None = None
        try:
            prepared = self._prepared(stream)
            if check is not None:
                engines = EngineFanout(self._check_urls(), timeout_s=600.0, name="miles-weight-check")
                check.prepare(engines, randomize=self.check_randomizes)
                prepared = check.observe(prepared)
            sent, buckets, metrics = self._deliver(prepared, version)
            if check is not None and engines is not None:
                # Reported, so a run can tell which of its updates were compared (and over how much).
                metrics = {**metrics, "checked_tensors": float(check.verify(engines))}
        except Exception:
            self._abort()
            # Keep step with the other trainer ranks (they are gathering the rest of the stream),
            # so a refused update fails this call without leaving anyone stuck in a collective.
            for _ in stream:
                pass
            raise
        finally:
            if engines is not None:
                engines.close()
        if buckets == 0:
            raise RuntimeError(f"{type(self).__name__}: no tensors to send for weight version {version}")
        return TransportStats(
            bytes_sent=sent,
            seconds=time.perf_counter() - t0,
            buckets=buckets,
            version=version,
            metrics=metrics,
        )

    def close(self) -> None:
        if self.rank == 0 and self.engine_urls:
            self._close()
        self.engine_urls = []

    # ------------------------------------------------------------ subclass

    def _delivers(self) -> bool:
        """Whether this rank talks to engines (rank 0 by default; P2P: every rank with planned targets)."""
        return self.rank == 0 and bool(self.engine_urls)

    def _check_urls(self) -> list[str]:
        """The engines this rank's weight-equality check compares: the ones it delivers to."""
        return self.engine_urls

    def _rearm_check(self) -> None:
        """Compare the engines with the trainer again around the next update (when the check is on):
        after the engine connections were re-formed, an engine restarted since the first update must be
        shown to hold exactly the trainer's weights too."""
        if self._check_settings is not None:
            mode, skip = self._check_settings
            self._check = WeightEqualityCheck(mode, skip)  # type: ignore[arg-type]
            self._check.adapter = self.adapter

    def _abort(self) -> None:
        """After a failed update, before the rest of the stream is drained (e.g. wait for writes in flight)."""
        return None

    @abc.abstractmethod
    def _deliver(
        self, prepared: Iterator[tuple[str, torch.Tensor]], version: int
    ) -> tuple[int, int, dict[str, float]]:
        """A delivering rank: get the prepared stream to the engines; returns (bytes, buckets, extra metrics)."""

    @abc.abstractmethod
    def _open(self) -> None:
        """Rank 0, once: connect to the engines (join a group, create a hand-off directory...)."""

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


class BucketedTransport(StreamTransport):
    """A transport that moves the stream bucket by bucket: subclasses implement ``_send_bucket``."""

    def _deliver(
        self, prepared: Iterator[tuple[str, torch.Tensor]], version: int
    ) -> tuple[int, int, dict[str, float]]:
        sent = buckets = 0
        for bucket in iter_buckets(prepared, self.bucket_bytes, expert_parallel=self.expert_parallel):
            self._send_bucket(bucket, version)
            sent += bucket.nbytes
            buckets += 1
        return sent, buckets, {}

    @abc.abstractmethod
    def _send_bucket(self, bucket: Bucket, version: int) -> None:
        """Deliver one bucket to every engine this rank feeds (one engine call per bucket)."""
