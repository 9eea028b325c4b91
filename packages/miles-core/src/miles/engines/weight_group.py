"""A standalone torch.distributed group between a trainer's rank 0 and rollout engines.

The trainer process already owns its default process group (its data-parallel
ranks), so the weight-broadcast group must be a separate object that never
touches the default group: both sides build it from a ``TCPStore`` (rank 0 hosts
it) and a backend object (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on
CUDA). Tensors are broadcast from rank 0 in the order both sides agreed on over
HTTP (``/update_weights_from_distributed``).

Used by the embedded engine (``/init_weights_update_group``) and by the
trainer-side broadcast transport, so both ends are built the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.errors import EngineError

if TYPE_CHECKING:
    import torch

BACKENDS = ("gloo", "nccl")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


# A bucket may travel as ONE broadcast of its tensors' bytes, each starting at a multiple of
# FLAT_ALIGN (so every dtype can be viewed in place), instead of one broadcast per tensor: far fewer
# collective calls for models with hundreds of tensors. Requested with this load_format (a Miles
# extension that the embedded engine implements; stock SGLang does not).
FLAT_LOAD_FORMAT = "miles_flat_bytes"
FLAT_ALIGN = 256


def flat_layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``nbytes`` bytes packed in order at FLAT_ALIGN boundaries, and the total size."""
    offsets: list[int] = []
    end = 0
    for n in nbytes:
        start = -(-end // FLAT_ALIGN) * FLAT_ALIGN
        offsets.append(start)
        end = start + int(n)
    return offsets, end


@dataclass
class WeightGroup:
    """One rank's end of a weight-broadcast group. Rank 0 is the sender."""

    name: str
    rank: int
    world_size: int
    backend: str
    device: str
    _pg: Any = field(repr=False)
    _store: Any = field(repr=False)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Send (rank ``src``) or receive (everyone else) ``tensor`` in place; blocks until done."""
        work = self._pg.broadcast(tensor, src)
        work.wait()

    def barrier(self) -> None:
        import torch

        # A one-element broadcast is a barrier that works the same on gloo and nccl.
        flag = torch.zeros(1, device=self.device)
        self.broadcast(flag, src=0)

    def destroy(self) -> None:
        """Release this rank's end; never waits for the other ranks.

        Every broadcast has completed by the time it returns, so nothing is in flight.
        NCCL's graceful shutdown would wait for the peers to tear down too (each side
        is torn down by a separate call, trainer first or engine first), so NCCL
        communicators are aborted, which is local.
        """
        pg, self._pg = self._pg, None
        if pg is not None:
            # An already broken group (peer gone) has nothing left to release.
            with contextlib.suppress(Exception):
                if self.backend == "nccl":
                    pg.abort()
                else:
                    pg.shutdown()
        self._store = None


def create_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    *,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    device: str | None = None,
    timeout_s: float = 300.0,
) -> WeightGroup:
    """Join (or, as rank 0, host) the group; returns once every rank has connected.

    Rank 0 listens on ``master_address:master_port`` (a ``TCPStore``); the other
    ranks connect to it. The call blocks until all ``world_size`` ranks have joined,
    so rank 0 and the engines must call it concurrently (the transport sends the
    engines' ``/init_weights_update_group`` requests in the background first).
    """
    import torch
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise EngineError(
            f"weight group {group_name!r}: backend {backend!r} is not supported; use one of {BACKENDS}"
        )
    if not 0 <= rank < world_size:
        raise EngineError(f"weight group {group_name!r}: rank {rank} is outside a world of size {world_size}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise EngineError(
            f"weight group {group_name!r}: backend 'nccl' needs CUDA, which this process does not have"
        )
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            master_address,
            int(master_port),
            world_size=None,
            is_master=(rank == 0),
            timeout=timeout,
            wait_for_workers=False,
        )
    except Exception as exc:
        role = "listen on" if rank == 0 else "connect to"
        raise EngineError(
            f"weight group {group_name!r}: rank {rank} could not {role} {master_address}:{master_port}: {exc}"
        ) from exc
    prefixed = dist.PrefixStore(f"miles/{group_name}/", store)
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in torch's stubs
            opts._timeout = timeout
            # Binding gloo to the loopback device when the master is local avoids picking an
            # interface the hostname resolves to but that is not reachable in sandboxes.
            if _is_loopback(master_address):
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            else:
                opts._devices = [dist.ProcessGroupGloo.create_default_device()]
            pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL = dist.ProcessGroupGloo(
                prefixed, rank, world_size, opts
            )
        else:
            torch.cuda.set_device(torch.device(device))
            # The stubs list only the Options overload; the constructor also takes a timedelta.
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, timeout)  # type: ignore[arg-type]
    except Exception as exc:
        raise EngineError(
            f"weight group {group_name!r}: rank {rank} of {world_size} failed to join over {backend} "
            f"(master {master_address}:{master_port}): {exc}"
        ) from exc
    group = WeightGroup(
        name=group_name,
        rank=rank,
        world_size=world_size,
        backend=backend,
        device=device,
        _pg=pg,
        _store=store,
    )
    # NCCL connects lazily: one collective here makes every backend return only once all ranks are in.
    group.barrier()
    return group
