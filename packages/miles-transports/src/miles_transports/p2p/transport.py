"""Peer-to-peer transport: trainer ranks write buckets straight into engine memory with Mooncake.

Who sends: the plan (:func:`~miles_transports.p2p.plan.plan_transfers`) gives each
trainer rank (source) the engines (targets) it feeds; every engine has exactly one
source. Every rank holds the full tensors while the weight stream is drained (the
stream gathers them), so any rank can send; ranks without targets only drain.

Set-up (each source, once): start a Mooncake ``TransferEngine`` (``P2PHANDSHAKE``,
no metadata server), allocate ONE staging buffer of ``bucket_mb`` and register it,
then ``POST /p2p/init`` to each of its engines, which answers with its session and
the address of its registered receive buffer (see :mod:`miles_transports.p2p.receiver`).

Per bucket: pack the bucket's tensors into the staging buffer (contiguous bytes,
offsets aligned to ``ALIGN``), then for each target in turn write the packed bytes
into its receive buffer (one Mooncake write) and ``POST /p2p/apply`` the layout;
``weight_version`` goes with the last bucket only. The write and apply to the LAST
target run in a background thread, overlapping the gathering of the next bucket;
the next bucket waits for them before it overwrites the staging buffer, and ``send``
waits for them before it returns. So at most one delivery runs at a time.

A tensor larger than the buffers travels alone: both buffers grow to fit it (the
engine's through ``/p2p/init`` again, same session) and stay at that size.

Faults: every Mooncake write and every HTTP call is bounded by ``timeout_s``; the
error names the engine URL, the bucket and what failed. After a timeout the write or
the engine's copy may still be in progress, so the transport refuses further
updates (reconnect it). The update is then incomplete, and no engine serves a mix:
an engine stages buckets until the one carrying ``weight_version`` commits them all
(``WeightUpdater.update_bucket``), and drops a staged update that a new update
(``bucket_index`` 0) replaces or that waits longer than its ``update_timeout_s``.
Engines fed by different sources may end on different versions; each engine's
``weight_version`` says which.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import Field

from miles.capabilities import TransportNeeds
from miles.engines.client import EngineCall, SyncEngineClient
from miles.errors import ConfigError, EngineError
from miles_transports.bucket import (
    Bucket,
    BucketedTransport,
    MiB,
    TransportOptions,
    iter_buckets,
    tensor_nbytes,
)
from miles_transports.p2p.plan import plan_transfers
from miles_transports.p2p.receiver import HANDSHAKE, PROTOCOLS, P2PError, load_transfer_engine

if TYPE_CHECKING:
    import torch

log = logging.getLogger("miles.transports.p2p")

#: Every tensor starts at a multiple of this many bytes in the buffers (a multiple of every item size).
ALIGN = 64

# Mooncake engines, buffers and threads of transports that timed out: a write may still be running
# in a thread that never returns, reading the staging buffer, so they are never freed.
_ABANDONED: list[Any] = []


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _in_thread(fn: Callable[[], Any], name: str) -> Future:
    """Run ``fn`` in a new daemon thread: one stuck in Mooncake must not keep the process from exiting."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _route_address(url: str) -> str:
    """The local address that reaches ``url``'s host (no packet is sent); 127.0.0.1 if there is none."""
    host = urlsplit(url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


@dataclass
class _Target:
    """One engine this rank writes to, and where its receive buffer is."""

    client: SyncEngineClient
    session: str = ""
    buffer_ptr: int = 0
    buffer_len: int = 0

    @property
    def url(self) -> str:
        return self.client.url


@dataclass(frozen=True)
class _Packed:
    """A bucket as laid out in the staging buffer: what ``/p2p/apply`` is told."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    span: int  # bytes to write, from the buffer's start


@dataclass
class _Pending:
    """The background delivery of a bucket to its last target."""

    future: Future
    target: _Target
    bucket: int


class P2POptions(TransportOptions):
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="the transfer engine's protocol")
    timeout_s: float = Field(120.0, description="seconds one update may take")
    local_hostname: str | None = Field(
        None, description="address the engines reach this trainer at (default: this host's)"
    )
    device_name: str = Field("", description="RDMA device to use (empty: the transfer engine picks)")


class P2PTransport(BucketedTransport):
    """``miles.interfaces.Transport`` writing into engine memory with Mooncake (entry point ``p2p``).

    Options: ``bucket_mb`` (also the size of the staging and receive buffers),
    ``dtype`` (cast floating-point tensors before sending), ``protocol`` (``tcp``, or
    ``rdma`` with the CUDA package), ``timeout_s`` (bound on each write and each HTTP
    call), ``local_hostname`` (this rank's address for Mooncake; default: the local
    address that routes to the first engine), ``device_name`` (Mooncake device filter,
    e.g. an RDMA NIC), and the weight-equality check options of ``BucketedTransport``.
    """

    needs = TransportNeeds(receiver="p2p")
    Options = P2POptions

    def __init__(
        self,
        bucket_mb: float = 512,
        dtype: str | None = None,
        protocol: str = "tcp",
        timeout_s: float = 120.0,
        local_hostname: str | None = None,
        device_name: str = "",
        # The weight-equality check (see weight_check.py); explicit, so a misspelt option is refused.
        check_equal: bool = False,
        check_mode: str = "exact",
        check_skip: Sequence[str] = (),
    ) -> None:
        super().__init__(
            bucket_mb=bucket_mb,
            dtype=dtype,
            check_equal=check_equal,
            check_mode=check_mode,
            check_skip=check_skip,
        )
        if protocol not in PROTOCOLS:
            raise ConfigError(f"p2p transport: protocol must be one of {list(PROTOCOLS)}, got {protocol!r}")
        if not timeout_s > 0:
            raise ConfigError(f"p2p transport: timeout_s must be > 0, got {timeout_s}")
        self.protocol = protocol
        self.timeout_s = float(timeout_s)
        self.local_hostname = local_hostname
        self.device_name = device_name
        self.plan: list[list[int]] = []
        self.targets: list[_Target] = []
        self._engine: Any = None  # mooncake.engine.TransferEngine
        self._staging: torch.Tensor | None = None
        self._pending: _Pending | None = None
        self._broken: str | None = None
        self._counters: dict[str, float] = {}

    # -------------------------------------------------------- Transport API

    def connect(self, engine_urls: list[str], *, rank: int, world_size: int, device: str) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"p2p transport: rank {rank} is outside a world of {world_size}")
        self.engine_urls = list(engine_urls)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.plan = plan_transfers(world_size, len(self.engine_urls))
        if self.plan[rank]:
            self._open()

    # --------------------------------------------- BucketedTransport hooks

    def _delivers(self) -> bool:
        return bool(self.targets)

    def _check_urls(self) -> list[str]:
        return [t.url for t in self.targets]  # each source checks the engines it feeds

    def _abort(self) -> None:
        self._settle(quiet=True)

    def _deliver(
        self, prepared: Iterator[tuple[str, torch.Tensor]], version: int
    ) -> tuple[int, int, dict[str, float]]:
        if self._broken is not None:
            raise EngineError(f"p2p transport: not usable since {self._broken}; close and connect it again")
        self._counters = {"wire_bytes": 0.0, "model_bytes": 0.0, "write_s": 0.0, "apply_s": 0.0}
        buckets = self._stream_buckets(prepared, version)
        c = self._counters
        metrics = {
            "p2p_targets": float(len(self.targets)),
            "p2p_model_bytes": c["model_bytes"],
            # Every engine receives the whole model once, whichever rank sends it.
            "p2p_fleet_bytes": c["model_bytes"] * len(self.engine_urls),
            "p2p_write_s": c["write_s"],
            "p2p_apply_s": c["apply_s"],
        }
        return int(c["wire_bytes"]), buckets, metrics

    def close(self) -> None:
        try:
            self._close()
        finally:
            self.targets = []
            self.engine_urls = []

    # ------------------------------------------------------------- set-up

    def _open(self) -> None:
        try:
            transfer_engine = load_transfer_engine()
        except P2PError as exc:
            raise ConfigError(f"p2p transport: {exc}") from exc
        urls = [self.engine_urls[i] for i in self.plan[self.rank]]
        hostname = self.local_hostname or _route_address(urls[0])
        try:
            self._engine = transfer_engine()
            rc = self._engine.initialize(hostname, HANDSHAKE, self.protocol, self.device_name)
            if rc != 0:
                raise EngineError(
                    f"p2p transport: Mooncake could not start a {self.protocol} transfer engine on "
                    f"{hostname!r} (initialize returned {rc}); set local_hostname to an address of this host"
                )
            self._allocate_staging(self.bucket_bytes)
            self.targets = [_Target(SyncEngineClient(url, timeout=self.timeout_s)) for url in urls]
            for target in self.targets:
                self._init_target(
                    target, self.bucket_bytes, f"p2p transport: connecting to engine {target.url}"
                )
        except BaseException:
            for target in self.targets:
                target.client.close()
            self.targets = []
            self._release()
            raise
        log.info(
            "p2p transport: rank %d writes to %d engine(s) over %s from %s",
            self.rank,
            len(self.targets),
            self.protocol,
            hostname,
        )

    def _allocate_staging(self, nbytes: int) -> None:
        """A new registered staging buffer; the old one is released only once the new one is in place."""
        import torch

        # Pinned host memory makes the device-to-host copies of a CUDA trainer fast.
        pinned = self.device.startswith("cuda") and torch.cuda.is_available()
        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        rc = self._engine.register_memory(staging.data_ptr(), nbytes)
        if rc != 0:
            raise EngineError(
                f"p2p transport: Mooncake refused to register the {nbytes}-byte staging buffer ({rc})"
            )
        self._free_staging()
        self._staging = staging

    def _call(self, target: _Target, path: str, body: dict[str, Any], where: str) -> Any:
        """POST ``body`` to ``target`` (bounded by ``timeout_s``); errors start with ``where``."""
        try:
            return target.client.call(EngineCall("POST", path, body), timeout=self.timeout_s)
        except EngineError as exc:
            if isinstance(exc.__cause__, httpx.TimeoutException):
                # The engine may still act on the call later (copy out of, or replace, its buffer):
                # nothing more can safely be written to it.
                self._broken = f"{where}: {path} timed out"
            raise EngineError(f"{where}: {exc}") from exc

    def _init_target(self, target: _Target, nbytes: int, where: str) -> None:
        body = {"bucket_bytes": nbytes, "protocol": self.protocol, "device_name": self.device_name}
        try:
            info = self._call(target, "/p2p/init", body, where)
        except EngineError as exc:
            if "HTTP 404" in str(exc):
                raise EngineError(
                    f"{where}: the engine has no /p2p/init endpoint; the p2p transport needs Miles' embedded "
                    "engine (SGLang servers do not implement it)"
                ) from exc
            raise
        if not isinstance(info, dict) or int(info.get("buffer_len", 0)) < nbytes or "session" not in info:
            raise EngineError(
                f"{where}: /p2p/init answered {info!r}; expected a session and a buffer of at least {nbytes} bytes"
            )
        target.session = str(info["session"])
        target.buffer_ptr = int(info["buffer_ptr"])
        target.buffer_len = int(info["buffer_len"])

    def _ensure_capacity(self, nbytes: int, bucket: int) -> None:
        """Grow the staging buffer and any receive buffer shorter than ``nbytes`` (to whole MiB)."""
        assert self._staging is not None
        size = -(-nbytes // MiB) * MiB
        if self._staging.numel() < nbytes:
            log.info(
                "p2p transport: bucket %d needs %d bytes; growing the buffers to %d", bucket, nbytes, size
            )
            self._allocate_staging(size)
        for target in self.targets:
            if target.buffer_len < nbytes:  # also one left short by an earlier failed attempt
                where = f"p2p transport: bucket {bucket} to engine {target.url} (growing its buffer)"
                self._init_target(target, size, where)

    # --------------------------------------------------------------- sending

    def _target_device(self) -> str:
        return self.device  # tensors are copied into the staging buffer from where they are

    def _stream_buckets(self, prepared: Iterator[tuple[str, torch.Tensor]], version: int) -> int:
        buckets = 0
        for bucket in iter_buckets(prepared, self.bucket_bytes, expert_parallel=self.expert_parallel):
            self._send_bucket(bucket, version)
            buckets += 1
        self._settle()
        return buckets

    def _send_bucket(self, bucket: Bucket, version: int) -> None:
        self._settle()  # the last target of the previous bucket is done with the staging buffer
        packed = self._pack(bucket)
        self._counters["model_bytes"] += bucket.nbytes
        *first, last = self.targets
        for target in first:
            self._write_and_apply(target, packed, bucket, version)
        future = _in_thread(
            lambda: self._write_and_apply(last, packed, bucket, version), name="miles-p2p-last"
        )
        self._pending = _Pending(future, last, bucket.index)

    def _pack(self, bucket: Bucket) -> _Packed:
        import torch

        offsets: list[int] = []
        end = 0
        for _, tensor in bucket.tensors:
            offsets.append(_align(end))
            end = offsets[-1] + tensor_nbytes(tensor)
        self._ensure_capacity(end, bucket.index)
        assert self._staging is not None
        for (_, tensor), offset in zip(bucket.tensors, offsets, strict=True):
            n = tensor_nbytes(tensor)
            if n:
                self._staging[offset : offset + n].copy_(tensor.reshape(-1).view(torch.uint8))
        return _Packed(
            names=bucket.names,
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket.tensors],
            shapes=[list(t.shape) for _, t in bucket.tensors],
            offsets=offsets,
            span=end,
        )

    def _write_and_apply(self, target: _Target, packed: _Packed, bucket: Bucket, version: int) -> None:
        """Write the packed bucket into ``target``'s buffer, then have it apply the bucket."""
        where = f"p2p transport: bucket {bucket.index} to engine {target.url}"
        t0 = time.perf_counter()
        if packed.span:
            self._write(target, packed.span, where)
        t1 = time.perf_counter()
        body: dict[str, Any] = {
            "session": target.session,
            "names": packed.names,
            "dtypes": packed.dtypes,
            "shapes": packed.shapes,
            "offsets": packed.offsets,
            "bucket_index": bucket.index,
        }
        if bucket.last:
            body["weight_version"] = str(version)
        self._call(target, "/p2p/apply", body, where)
        self._counters["write_s"] += t1 - t0
        self._counters["apply_s"] += time.perf_counter() - t1
        self._counters["wire_bytes"] += packed.span

    def _write(self, target: _Target, nbytes: int, where: str) -> None:
        """One Mooncake write of the staging buffer's first ``nbytes`` bytes, bounded by ``timeout_s``.

        The packed bucket is one contiguous range, so one write covers it (a batch of
        pieces was no faster over tcp). Mooncake's synchronous write has no deadline of its
        own (the first write to a stopped peer hangs in the handshake), so it runs in a
        daemon thread and this one stops waiting at the deadline.
        """
        assert self._staging is not None
        engine, src = self._engine, self._staging.data_ptr()
        future = _in_thread(
            lambda: engine.transfer_sync_write(target.session, src, target.buffer_ptr, nbytes),
            name="miles-p2p-write",
        )
        try:
            rc = future.result(timeout=self.timeout_s)
        except TimeoutError:
            self._broken = f"{where}: a write timed out"
            raise EngineError(
                f"{where}: writing {nbytes} bytes to Mooncake session {target.session} did not complete within "
                f"timeout_s = {self.timeout_s:g} s (is the engine stopped or unreachable?); the update is "
                "incomplete and the engine keeps its previous weights"
            ) from None
        if rc != 0:
            raise EngineError(
                f"{where}: writing {nbytes} bytes to Mooncake session {target.session} failed (returned {rc}); "
                "is the engine alive and that address reachable from this host?"
            )

    def _settle(self, *, quiet: bool = False) -> None:
        """Wait for the background delivery to the last target (bounded: its write and call time out)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except Exception:
            if not quiet:
                raise
            log.warning(
                "p2p transport: delivery of bucket %d to %s also failed", pending.bucket, pending.target.url
            )

    # ------------------------------------------------------------- teardown

    def _close(self) -> None:
        """Wait for the last delivery, close the engines' receivers, free the staging buffer."""
        try:
            self._settle(quiet=True)
            for target in self.targets:
                if self._broken is None:
                    try:
                        self._call(target, "/p2p/close", {}, f"p2p transport: closing engine {target.url}")
                    except EngineError as exc:  # an engine that is gone has no receiver left to close
                        log.warning("%s", exc)
                target.client.close()
        finally:
            self._release()

    def _free_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None and self._engine is not None:
            self._engine.unregister_memory(staging.data_ptr())

    def _release(self) -> None:
        if self._broken is not None:
            # A write thread may still be inside Mooncake, reading the staging buffer: keep both alive.
            _ABANDONED.append((self._engine, self._staging))
            self._engine = self._staging = None
            return
        self._free_staging()
        self._engine = None  # the last reference: Mooncake shuts its engine down
