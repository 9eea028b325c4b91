"""Engine side of peer-to-peer weight updates: one receive buffer that trainer ranks write into.

A trainer rank (the source) writes each bucket of packed tensor bytes straight into
this engine's memory with Mooncake's TransferEngine, then tells the engine where
each tensor lies (``POST /p2p/apply``, see :mod:`miles_transports.p2p.routes`). The engine copies the
tensors out (the buffer is reused by the next bucket) and hands them to the same
staged, all-or-nothing path as every other multi-bucket update
(:meth:`~miles.engines.embedded.weights.WeightUpdater.update_bucket`): buckets are
staged until the one carrying ``weight_version`` commits the whole update.

Buffer layout (what ``/p2p/apply`` describes): tensor ``i`` occupies bytes
``[offsets[i], offsets[i] + numel * itemsize)`` of the buffer, in its dtype's native
(little-endian) byte order, C-contiguous; ranges must lie inside the buffer, must not
overlap, and each offset must be a multiple of the tensor's item size.

One receiver per engine: ``/p2p/init`` creates it (a TransferEngine speaking
``protocol``, plus a buffer of ``bucket_bytes`` on the model's device, registered
with it) or, called again, keeps its TransferEngine and replaces the buffer when the
size changes (a trainer grows it for a tensor larger than its bucket). Memory that is
no longer registered cannot be written: Mooncake's receiving side refuses writes
outside registered buffers, so a late write from a sender that gave up cannot land
in freed memory.

Mooncake is optional (``pip install 'miles-transports[p2p]'``); it is imported only
when a receiver is created.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.engines.embedded.weights import BucketOutcome, WeightUpdateError, WeightUpdater, parse_dtype

log = logging.getLogger("miles_transports.p2p")

#: Protocols Miles passes to Mooncake's ``TransferEngine.initialize``: ``tcp`` runs anywhere
#: (and is what CPU tests use); ``rdma`` needs the CUDA package and an RDMA NIC.
PROTOCOLS = ("tcp", "rdma")
#: Mooncake's peer-to-peer mode: peers exchange their metadata in a handshake, no metadata server.
HANDSHAKE = "P2PHANDSHAKE"

MOONCAKE_MISSING = (
    "peer-to-peer weight updates need Mooncake's transfer engine (Python module 'mooncake'), which is not "
    "installed here: pip install 'miles-transports[p2p]' (CPU, tcp) or 'miles-transports[p2p-cuda]' "
    "(CUDA, rdma); the two extras exclude each other"
)


class P2PError(WeightUpdateError):
    """A P2P request was refused (bad layout, no receiver, Mooncake missing or failing); weights unchanged."""


def load_transfer_engine() -> type:
    """Mooncake's ``TransferEngine`` class, or a :class:`P2PError` naming the extra to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # also a broken install, e.g. a missing libibverbs.so.1
        raise P2PError(f"{MOONCAKE_MISSING} (import failed: {exc})") from exc
    return TransferEngine


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in the receive buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_layout(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    offsets: Sequence[int],
    buffer_len: int,
) -> list[TensorSlot]:
    """Check an ``/p2p/apply`` layout against a buffer of ``buffer_len`` bytes (see the module doc)."""
    if not len(names) == len(dtypes) == len(shapes) == len(offsets):
        raise P2PError(
            f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes and {len(offsets)} offsets: "
            "give one of each per tensor"
        )
    slots: list[TensorSlot] = []
    for name, dtype_text, shape, offset in zip(names, dtypes, shapes, offsets, strict=True):
        try:
            dtype = parse_dtype(dtype_text)
        except WeightUpdateError as exc:
            raise P2PError(f"tensor {name!r}: {exc}") from None
        if any(int(d) < 0 for d in shape):
            raise P2PError(f"tensor {name!r}: shape {list(shape)} has a negative dimension")
        slot = TensorSlot(name, dtype, tuple(int(d) for d in shape), int(offset))
        if slot.offset < 0 or slot.offset + slot.nbytes > buffer_len:
            raise P2PError(
                f"tensor {name!r}: bytes [{slot.offset}, {slot.offset + slot.nbytes}) are outside the receive "
                f"buffer of {buffer_len} bytes"
            )
        if slot.offset % dtype.itemsize:
            raise P2PError(
                f"tensor {name!r}: offset {slot.offset} is not a multiple of its item size {dtype.itemsize}"
            )
        slots.append(slot)
    ordered = sorted((s for s in slots if s.nbytes), key=lambda s: s.offset)
    for before, after in itertools.pairwise(ordered):
        if before.offset + before.nbytes > after.offset:
            raise P2PError(f"tensors {before.name!r} and {after.name!r} overlap in the receive buffer")
    return slots


class P2PReceiver:
    """A Mooncake TransferEngine and the one buffer registered with it.

    ``session`` (``host:port``) is what a sender passes to Mooncake as the target;
    ``buffer_ptr`` / ``buffer_len`` are the address range it may write.
    """

    def __init__(
        self, *, hostname: str, protocol: str, device_name: str, nbytes: int, device: torch.device
    ) -> None:
        if protocol not in PROTOCOLS:
            raise P2PError(f"protocol {protocol!r} is not supported; use one of {list(PROTOCOLS)}")
        transfer_engine = load_transfer_engine()
        self.hostname, self.protocol, self.device_name, self.device = hostname, protocol, device_name, device
        self._engine = transfer_engine()
        # With P2PHANDSHAKE and no port in the hostname, Mooncake picks a free RPC port itself.
        rc = self._engine.initialize(hostname, HANDSHAKE, protocol, device_name)
        if rc != 0:
            raise P2PError(
                f"Mooncake could not start a {protocol} transfer engine on {hostname!r} (device {device_name!r}): "
                f"initialize returned {rc}"
            )
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"
        self.buffer: torch.Tensor | None = None
        self.resize(nbytes)

    @property
    def buffer_ptr(self) -> int:
        assert self.buffer is not None
        return self.buffer.data_ptr()

    @property
    def buffer_len(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def matches(self, *, hostname: str, protocol: str, device_name: str) -> bool:
        return (self.hostname, self.protocol, self.device_name) == (hostname, protocol, device_name)

    def resize(self, nbytes: int) -> None:
        """Make the registered buffer exactly ``nbytes`` long (a new buffer when the size changes).

        The new buffer is allocated and registered before the old one is released, so a
        failure leaves the receiver as it was.
        """
        if nbytes < 1:
            raise P2PError(f"bucket_bytes must be at least 1, got {nbytes}")
        if self.buffer is not None and self.buffer.numel() == nbytes:
            return
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # out of memory
            raise P2PError(
                f"cannot allocate a receive buffer of {nbytes} bytes on {self.device}: {exc}"
            ) from exc
        rc = self._engine.register_memory(buffer.data_ptr(), nbytes)
        if rc != 0:
            raise P2PError(
                f"Mooncake refused to register the {nbytes}-byte receive buffer: register_memory -> {rc}"
            )
        self._release_buffer()
        self.buffer = buffer

    def read(
        self, slots: Sequence[TensorSlot], targets: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Copy the tensors out of the buffer, each cast to and placed like the model tensor it replaces.

        The copies are new memory: the buffer may be overwritten by the next bucket as
        soon as this returns. ``targets`` are the model's tensors (names already checked).
        """
        assert self.buffer is not None
        out: dict[str, torch.Tensor] = {}
        for slot in slots:
            raw = self.buffer[slot.offset : slot.offset + slot.nbytes]
            view = raw.view(slot.dtype).view(slot.shape)
            target = targets[slot.name]
            out[slot.name] = view.to(device=target.device, dtype=target.dtype, copy=True)
        return out

    def close(self) -> None:
        self._release_buffer()
        # Dropping the last reference shuts Mooncake's engine down (its RPC server and workers).
        self._engine = None

    def _release_buffer(self) -> None:
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            rc = self._engine.unregister_memory(buffer.data_ptr())
            if rc != 0:
                log.warning("p2p: unregister_memory of the receive buffer returned %d", rc)

    def describe(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "protocol": self.protocol,
            "buffer_ptr": self.buffer_ptr,
            "buffer_len": self.buffer_len,
        }


class P2PService:
    """The engine's P2P state: at most one receiver, and the calls the HTTP routes make.

    ``lock`` keeps a receiver from being replaced or closed while a bucket is copied
    out of its buffer. Weight changes themselves are serialized by the updater.
    """

    def __init__(self, weights: WeightUpdater, device: torch.device) -> None:
        self.weights = weights
        self.device = device
        self.receiver: P2PReceiver | None = None
        self.lock = threading.Lock()

    def init(
        self, *, bucket_bytes: int, protocol: str, hostname: str, device_name: str = ""
    ) -> dict[str, Any]:
        """Create the receiver, or resize the one there is; returns its session and buffer."""
        with self.lock:
            current = self.receiver
            if current is not None and current.matches(
                hostname=hostname, protocol=protocol, device_name=device_name
            ):
                current.resize(bucket_bytes)
                return current.describe()
            if current is not None:
                self.receiver = None
                current.close()
            self.receiver = P2PReceiver(
                hostname=hostname,
                protocol=protocol,
                device_name=device_name,
                nbytes=bucket_bytes,
                device=self.device,
            )
            log.info(
                "p2p: receiving on %s (%s), %d-byte buffer", self.receiver.session, protocol, bucket_bytes
            )
            return self.receiver.describe()

    def apply(
        self,
        *,
        session: str,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        offsets: Sequence[int],
        weight_version: str | None,
        bucket_index: int | None,
    ) -> BucketOutcome:
        """Take the bucket the sender has just written: stage it, or commit the update (``weight_version``)."""
        with self.lock:
            receiver = self.receiver
            if receiver is None:
                raise P2PError("this engine has no P2P receiver: POST /p2p/init first")
            if session != receiver.session:
                raise P2PError(
                    f"session {session!r} is not this engine's P2P session {receiver.session!r} (the receiver "
                    "was re-created since); call /p2p/init again and resend the update"
                )

            def read() -> dict[str, torch.Tensor]:
                slots = parse_layout(names, dtypes, shapes, offsets, receiver.buffer_len)
                self.weights.check((s.name, s.shape, s.dtype) for s in slots)
                return receiver.read(slots, self.weights.targets)

            return self.weights.update_bucket(read, weight_version=weight_version, bucket_index=bucket_index)

    def close(self) -> bool:
        """Drop the receiver (its buffer and TransferEngine); False when there was none."""
        with self.lock:
            receiver, self.receiver = self.receiver, None
        if receiver is None:
            return False
        receiver.close()
        return True

    def describe(self) -> dict[str, Any] | None:
        receiver = self.receiver
        return None if receiver is None else receiver.describe()
