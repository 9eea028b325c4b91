"""Broadcast transport: rank 0 broadcasts each bucket over a weight-update group that includes the engines.

Set-up (rank 0, once): host a ``TCPStore`` on a free port and ask every engine to
join (``/init_weights_update_group``; engine ``i`` takes ranks from
``1 + i * ranks_per_engine``) while joining as rank 0 at the same time, since
joining blocks until everyone is in. Per bucket: post
``/update_weights_from_distributed`` (names, dtypes, shapes, weight version) to every
engine in background threads (each request returns once its engine has received and
loaded the bucket), broadcast the tensors in that order, then check that every engine
answered success. gloo on CPU, NCCL on CUDA; the group is separate from the trainer's
own default process group (see ``miles.engines.weight_group``).

Restarted engines (``reconnect``): a process that dies takes its end of the group with it,
and a torch.distributed group cannot take in a new member, so the group is re-formed: rank 0
releases its end first (local on both backends, so a dead member cannot hang it, and an
engine still waiting in the old group gets a closed connection instead of waiting for its
timeout), every engine is asked to destroy its end (a restarted one has none), and all of
them join a new group under a new name on a fresh rendezvous. Updates send whole tensors, so
the next update brings a restarted engine to the trainer's weights like every other engine.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import wait
from typing import Any

from pydantic import Field

from miles.capabilities import EnginePrep, EngineSetup, TransportNeeds
from miles.engines.weight_group import FLAT_LOAD_FORMAT, flat_layout
from miles.errors import ConfigError, EngineError
from miles_transports.bucket import Bucket, BucketedTransport, TransportOptions
from miles_transports.fanout import EngineFanout

log = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BroadcastOptions(TransportOptions):
    backend: str | None = Field(
        None, description="torch.distributed backend of the weight group (default: nccl on cuda, else gloo)"
    )
    master_address: str = Field("127.0.0.1", description="address the weight group's rendezvous listens on")
    master_port: int | None = Field(None, description="its port (default: a free one)")
    ranks_per_engine: int = Field(
        1, description="ranks each engine has in the weight group (its tensor-parallel size)"
    )
    group_name: str | None = Field(None, description="the weight group's name (default: one per run)")
    timeout_s: float = Field(600.0, description="seconds one update may take")
    flatten: bool = Field(
        False, description="send each bucket as one flat buffer (default: where the engine takes it)"
    )


class BroadcastTransport(BucketedTransport):
    """``miles.interfaces.Transport`` over a torch.distributed broadcast group (the default transport)."""

    carries_adapters = True  # a LoRA update is named tensors like any other

    needs = TransportNeeds(receiver="weight-group")
    Options = BroadcastOptions

    @staticmethod
    def prepare_engines(setup: EngineSetup) -> EnginePrep:
        """Send a bucket as one broadcast of its bytes to engines that take that (the embedded engine);
        SGLang needs one broadcast per tensor. weight_sync.options.flatten still decides if given."""
        flat = "weight-group" in setup.engine.flat_receivers
        return EnginePrep(transport_options={"flatten": setup.options.get("flatten", flat)})

    def __init__(
        self,
        bucket_mb: float = 512,
        dtype: str | None = None,
        backend: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        ranks_per_engine: int = 1,
        group_name: str | None = None,
        timeout_s: float = 600.0,
        flatten: bool = False,
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
        if backend not in (None, "gloo", "nccl"):
            raise ConfigError(
                f"broadcast transport: backend must be gloo, nccl or null (auto), got {backend!r}"
            )
        if ranks_per_engine < 1:
            raise ConfigError(f"broadcast transport: ranks_per_engine must be >= 1, got {ranks_per_engine}")
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.ranks_per_engine = ranks_per_engine
        self.group_name = group_name or f"miles-weights-{uuid.uuid4().hex[:8]}"
        # Re-formed groups are named after the first one (engines refuse a second group of one name).
        self._base_group_name = self.group_name
        self._formations = 0
        self.timeout_s = timeout_s
        # One broadcast of each bucket's bytes instead of one per tensor (a Miles engine extension;
        # the run turns it on for the embedded engine, stock SGLang needs it off).
        self.flatten = flatten
        self._group: Any = None
        self._engines: EngineFanout | None = None

    def _target_device(self) -> str:
        return self._group.device if self._group is not None else "cpu"

    def _open(self) -> None:
        try:
            self._form_group()
        except BaseException:
            if self._engines is not None:
                self._engines.close()
                self._engines = None
            raise

    def reconnect(self, engine_urls: list[str]) -> None:
        """Re-form the weight group with ``engine_urls`` (see the module docstring); every rank calls it.

        Blocks until every engine has joined the new group, like the first formation. With
        ``check_equal`` on, the next update is compared again (engines randomised first), so a
        restarted engine is shown to serve exactly the trainer's weights.
        """
        if self.rank != 0 or not engine_urls:
            self.engine_urls = list(engine_urls)
            return
        old_name = self.group_name
        group, self._group = self._group, None
        engines, self._engines = self._engines, None
        if group is not None:
            group.destroy()  # ours first: never waits for a peer (a dead one included)
        if engines is not None:
            try:
                self._destroy_on_engines(engines, old_name)
            finally:
                engines.close()
        self.engine_urls = list(engine_urls)
        self._formations += 1
        self.group_name = f"{self._base_group_name}-r{self._formations}"
        self._open()
        self._rearm_check()
        log.info(
            "broadcast transport: weight group re-formed as %r with %d engine(s)",
            self.group_name,
            len(self.engine_urls),
        )

    @staticmethod
    def _destroy_on_engines(engines: EngineFanout, name: str) -> None:
        """Ask every engine to drop its end of group ``name``; a restarted engine has none."""
        futures = engines.submit("destroy_weights_update_group", name)
        for url, future in zip(engines.urls, futures, strict=True):
            try:
                future.result(timeout=60.0)
            except EngineError as exc:
                if f"no weight group {name!r}" in str(exc):
                    continue  # a restarted process: its end of the group died with the old one
                # Not fatal here: the new group has another name, and the join that follows fails,
                # naming this engine, if it cannot be reached.
                log.warning(
                    "broadcast transport: engine %s did not destroy weight group %r: %s", url, name, exc
                )
            except Exception as exc:
                log.warning(
                    "broadcast transport: engine %s did not destroy weight group %r: %r", url, name, exc
                )

    def _form_group(self) -> None:
        from miles.engines.weight_group import create_weight_group

        backend = self.backend or ("nccl" if self.device.startswith("cuda") else "gloo")
        port = self.master_port or _free_port(self.master_address)
        world_size = 1 + self.ranks_per_engine * len(self.engine_urls)
        self._engines = EngineFanout(self.engine_urls, self.timeout_s, name="miles-bcast")
        joins = self._engines.submit(
            "init_weights_update_group",
            self.master_address,
            port,
            world_size=world_size,
            group_name=self.group_name,
            backend=backend,
            per_engine=[{"rank_offset": 1 + i * self.ranks_per_engine} for i in range(len(self.engine_urls))],
        )
        outcome: dict[str, Any] = {}

        def join() -> None:
            try:
                outcome["group"] = create_weight_group(
                    self.master_address,
                    port,
                    0,
                    world_size,
                    group_name=self.group_name,
                    backend=backend,
                    device=self.device if backend == "nccl" else "cpu",
                    timeout_s=self.timeout_s,
                )
            except BaseException as exc:
                outcome["error"] = exc

        # Joining blocks until every engine is in. An engine that refuses (a stale group of the same
        # name, no CUDA for nccl...) answers at once: stop waiting then, instead of at the timeout.
        # The join thread is a daemon so a join that will never complete cannot hold the process.
        joiner = threading.Thread(target=join, name="miles-weight-group-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(timeout=0.1)
            if any(f.done() and f.exception() is not None for f in joins):
                self._engines.gather(joins, "/init_weights_update_group")  # raises, naming the engines
        if "error" in outcome:
            # The engines' answers usually say more than our side of a failed rendezvous.
            wait(joins, timeout=5.0)
            if all(f.done() for f in joins):
                self._engines.gather(joins, "/init_weights_update_group")
            raise EngineError(
                f"broadcast transport: could not form the weight group with the engines: {outcome['error']}"
            ) from outcome["error"]
        self._group = outcome["group"]
        self._engines.gather(joins, "/init_weights_update_group")

    def _send_bucket(self, bucket: Bucket, version: int) -> None:
        assert self._engines is not None and self._group is not None
        futures = self._engines.submit(
            "update_weights_from_distributed",
            bucket.names,
            [str(t.dtype) for _, t in bucket.tensors],
            [list(t.shape) for _, t in bucket.tensors],
            group_name=self.group_name,
            weight_version=version if bucket.last else None,
            flush_cache=bucket.last,
            load_format=FLAT_LOAD_FORMAT if self.flatten else None,
        )
        broadcast_error: BaseException | None = None
        try:
            if self.flatten:
                self._group.broadcast(_flat_bytes(bucket, self._group.device), src=0)
            else:
                for _, tensor in bucket.tensors:
                    self._group.broadcast(tensor, src=0)
        except Exception as exc:  # the engines' answers usually say why the group broke
            broadcast_error = exc
        try:
            self._engines.gather(futures, "/update_weights_from_distributed")
        except EngineError as exc:
            raise exc from broadcast_error
        if broadcast_error is not None:
            raise EngineError(
                f"broadcast transport: broadcasting bucket {bucket.index} failed: {broadcast_error}"
            ) from broadcast_error

    def _close(self) -> None:
        group, self._group = self._group, None
        engines, self._engines = self._engines, None
        try:
            if engines is not None and group is not None:
                # An engine that is gone has no group left to destroy.
                with contextlib.suppress(EngineError):
                    engines.call_all("destroy_weights_update_group", self.group_name)
        finally:
            if group is not None:
                group.destroy()
            if engines is not None:
                engines.close()


def _flat_bytes(bucket: Bucket, device: str) -> Any:
    """The bucket's tensors as one byte buffer, laid out as ``flat_layout`` says (what the engine expects)."""
    import torch

    sizes = [t.numel() * t.element_size() for _, t in bucket.tensors]
    offsets, total = flat_layout(sizes)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, tensor), offset, n in zip(bucket.tensors, offsets, sizes, strict=True):
        if n:
            buf[offset : offset + n].copy_(tensor.reshape(-1).view(torch.uint8))
    return buf
