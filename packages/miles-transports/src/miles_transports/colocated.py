"""Colocated transport: trainer and engines share a machine, so buckets travel as files in shared memory.

Per bucket, rank 0 writes one safetensors file into the hand-off directory (the
engines were started with ``--handoff-dir`` naming the same directory), asks every
engine to load it (``/update_weights_from_tensor`` with ``load_format:
"miles_safetensors_file"``; an engine resolves the bare file name inside its own
hand-off directory and never unpickles anything), and deletes the file once every
engine has answered.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence

from pydantic import Field

from miles.capabilities import EnginePrep, EngineSetup, TransportNeeds
from miles.engines.client import HANDOFF_LOAD_FORMAT
from miles.errors import ConfigError
from miles_transports.bucket import Bucket, BucketedTransport, TransportOptions
from miles_transports.fanout import EngineFanout


def make_handoff_dir(prefix: str = "miles-handoff-") -> str:
    """A fresh private directory for weight files: under ``/dev/shm`` (RAM) when the machine has it."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def _unaliased(bucket: Bucket) -> dict:
    """The bucket as a dict safetensors accepts: it refuses tensors that share storage (tied weights)."""
    seen: set[int] = set()
    out = {}
    for name, t in bucket.tensors:
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


class ColocatedOptions(TransportOptions):
    handoff_dir: str | None = Field(
        None,
        description="directory the trainer hands tensors to the engines in (default: in the run directory)",
    )
    timeout_s: float = Field(600.0, description="seconds one update may take")


class ColocatedTransport(BucketedTransport):
    """``miles.interfaces.Transport`` through safetensors files in a directory trainer and engines share."""

    carries_adapters = True  # a LoRA update is named tensors like any other

    # Trainer and engines share the devices (the trainer is offloaded while they generate), and the
    # hand-off directory is on this machine.
    needs = TransportNeeds(placement="colocated", launched_engines=True, receiver="handoff-files")
    Options = ColocatedOptions

    @staticmethod
    def prepare_engines(setup: EngineSetup) -> EnginePrep:
        """A private hand-off directory (in RAM where the machine has /dev/shm), removed after the run."""
        handoff = make_handoff_dir()
        setup.stack.callback(shutil.rmtree, handoff, ignore_errors=True)
        return EnginePrep(engine_options={"handoff_dir": handoff}, transport_options={"handoff_dir": handoff})

    def __init__(
        self,
        bucket_mb: float = 512,
        dtype: str | None = None,
        handoff_dir: str | None = None,
        timeout_s: float = 600.0,
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
        self.handoff_dir = handoff_dir
        self.timeout_s = timeout_s
        self._engines: EngineFanout | None = None

    def _open(self) -> None:
        if not self.handoff_dir:
            raise ConfigError(
                "colocated transport: the transport option handoff_dir is required (the directory the engines "
                "were started with, --handoff-dir)"
            )
        if not os.path.isdir(self.handoff_dir):
            raise ConfigError(f"colocated transport: handoff_dir {self.handoff_dir!r} is not a directory")
        self._engines = EngineFanout(self.engine_urls, self.timeout_s, name="miles-coloc")

    def _send_bucket(self, bucket: Bucket, version: int) -> None:
        from safetensors.torch import save_file

        assert self._engines is not None and self.handoff_dir is not None
        filename = f"w{version}-b{bucket.index:05d}-{uuid.uuid4().hex[:8]}.safetensors"
        path = os.path.join(self.handoff_dir, filename)
        try:
            save_file(_unaliased(bucket), path, metadata={"weight_version": str(version)})
            self._engines.call_all(
                "update_weights_from_tensor",
                [filename],
                version if bucket.last else None,
                load_format=HANDOFF_LOAD_FORMAT,
                flush_cache=bucket.last,
            )
        finally:
            if os.path.exists(path):
                os.remove(path)

    def reconnect(self, engine_urls: list[str]) -> None:
        """Engines were restarted (same URLs): talk to them over fresh connections.

        Nothing else ties this transport to an engine process: every update hands over whole
        weights through files, so a restarted engine takes the next one like the others.
        """
        self.engine_urls = list(engine_urls)
        if self.rank == 0 and self._engines is not None:
            old, self._engines = (
                self._engines,
                EngineFanout(self.engine_urls, self.timeout_s, name="miles-coloc"),
            )
            old.close()

    def _close(self) -> None:
        engines, self._engines = self._engines, None
        if engines is not None:
            engines.close()
