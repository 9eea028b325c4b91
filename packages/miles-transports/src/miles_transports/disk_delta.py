"""Disk-delta transport: publish only the bytes that changed; every engine host verifies and applies them.

Every engine starts from the same base checkpoint (the one the trainer loaded). The
trainer's rank 0 keeps a byte snapshot of what the engines hold, seeded from its own
weights right after start-up (``seed``, before any training step, so it equals the
checkpoint bit for bit in the engines' dtype). Each update publishes
``delta_dir/v{version:06d}/`` through :class:`miles_transports.weight_delta.DeltaWriter`: per
changed tensor its XOR (or overwrite) delta against the snapshot, zstd-compressed,
every file written atomically and the index last. Then every engine is asked to apply
that version (``/update_weights_from_disk_delta``): it checks the index, that the base
version is the one it holds, the digest of every resulting tensor, and only then swaps
the new tensors in (the only moment its generation pauses). An engine that refuses
keeps its old weights and version, and the driver's version check stops the run.

``delta_dir`` must be visible to every engine host at the same path (shared storage);
on one machine it is a directory of the run. The engines are launched with it as
their ``delta_root``, the only place their delta endpoint reads from.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from miles.capabilities import EnginePrep, EngineSetup, TransportNeeds
from miles.errors import ConfigError
from miles_transports.bucket import StreamTransport, TransportOptions
from miles_transports.fanout import EngineFanout

if TYPE_CHECKING:
    import torch


class DiskDeltaOptions(TransportOptions):
    delta_dir: str | None = Field(
        None, description="directory of the versions (v000001/, ...; default: in the run directory)"
    )
    encoding: Literal["xor", "overwrite"] = Field(
        "xor", description="how a version is stored: xor against the last one, or overwrite"
    )
    level: int = Field(1, description="zstd compression level")
    keep: int = Field(3, description="versions kept on disk")
    timeout_s: float = Field(600.0, description="seconds one update may take")


class DiskDeltaTransport(StreamTransport):
    """``miles.interfaces.Transport`` publishing weight deltas to a shared directory (``transport: disk-delta``)."""

    # The rank calls ``seed`` with the freshly loaded weights right after ``connect``.
    wants_base_weights = True
    # A delta applies to the engines' current bytes: they must stay the base, not random values.
    check_randomizes = False
    needs = TransportNeeds(receiver="disk-delta")
    Options = DiskDeltaOptions

    @staticmethod
    def prepare_engines(setup: EngineSetup) -> EnginePrep:
        """Engines read deltas only from the delta directory (<run>/weight_deltas unless
        weight_sync.options.delta_dir names shared storage); the trainer's snapshot is kept in the
        engines' dtype, so a delta applies to exactly the bytes they hold."""
        delta_dir = os.path.abspath(
            setup.options.get("delta_dir") or os.path.join(setup.work_dir, "weight_deltas")
        )
        dtype = setup.options.get("dtype") or setup.engine_dtype
        return EnginePrep(
            engine_options={"delta_root": delta_dir},
            transport_options={"delta_dir": delta_dir, "dtype": dtype},
        )

    def __init__(
        self,
        delta_dir: str | None = None,
        encoding: str = "xor",
        level: int = 1,
        keep: int = 3,
        dtype: str | None = None,
        timeout_s: float = 600.0,
        bucket_mb: float = 512,  # accepted for a uniform weight_sync section; a delta is one whole version
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
        if not delta_dir:
            raise ConfigError(
                "disk-delta transport: delta_dir is required (the run sets it to <run>/weight_deltas unless "
                "weight_sync.options.delta_dir names shared storage)"
            )
        if encoding not in ("xor", "overwrite"):
            raise ConfigError(f"disk-delta transport: encoding must be xor or overwrite, got {encoding!r}")
        if keep < 2:
            raise ConfigError(f"disk-delta transport: keep must be >= 2 (a version and its base), got {keep}")
        self.delta_dir = os.path.abspath(delta_dir)
        self.encoding = encoding
        self.level = level
        self.keep = keep
        self.timeout_s = timeout_s
        self._writer: Any = None
        self._engines: EngineFanout | None = None

    def _open(self) -> None:
        from miles_transports.weight_delta import DeltaWriter

        # Versions left by an earlier run in this directory describe other weights: start clean.
        if os.path.isdir(self.delta_dir):
            shutil.rmtree(self.delta_dir)
        os.makedirs(self.delta_dir)
        self._writer = DeltaWriter(self.delta_dir, encoding=self.encoding, level=self.level, keep=self.keep)
        self._engines = EngineFanout(self.engine_urls, timeout_s=self.timeout_s, name="miles-disk-delta")

    def seed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Record the weights the engines start from (a collective: every rank drains the stream)."""
        if self.rank != 0 or self._writer is None:
            for _ in named_tensors:
                pass
            return
        self._writer.seed(self._prepared(iter(named_tensors)), version)

    def _deliver(
        self, prepared: Iterator[tuple[str, torch.Tensor]], version: int
    ) -> tuple[int, int, dict[str, float]]:
        assert self._writer is not None and self._engines is not None
        stats = self._writer.publish(prepared, version)
        self._engines.call_all("update_weights_from_disk_delta", version, weight_version=str(version))
        metrics = {
            "delta_file_bytes": float(stats.file_bytes),
            "delta_changed_bytes": float(stats.changed_bytes),
            "delta_density": stats.changed_bytes / stats.total_bytes if stats.total_bytes else 0.0,
            "delta_tensors_changed": float(stats.tensors_changed),
            "delta_publish_s": stats.seconds,
        }
        return stats.file_bytes, 1, metrics

    def reconnect(self, engine_urls: list[str]) -> None:
        """Engines were restarted (same URLs): talk to them over fresh connections.

        The published versions and the base stay as they are (they live in ``delta_dir``, not in
        an engine); a restarted engine lacks the base a delta applies to, so the driver brings it
        to the fleet's version from a snapshot (``miles.driver.fleet``), then it takes the next delta.
        """
        self.engine_urls = list(engine_urls)
        if self.rank == 0 and self._engines is not None:
            old = self._engines
            self._engines = EngineFanout(self.engine_urls, timeout_s=self.timeout_s, name="miles-disk-delta")
            old.close()

    def _close(self) -> None:
        if self._engines is not None:
            self._engines.close()
            self._engines = None
