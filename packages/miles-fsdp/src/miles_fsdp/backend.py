"""The FSDP2 backend as the driver sees it: a thin controller over its rank processes.

``setup`` spawns ``fsdp.num_ranks`` processes (gloo on CPU, NCCL on one GPU per
rank), each of which loads the Hugging Face model as is and shards it (see
``rank.py``). Every other method sends one command to every rank and waits for all
answers. A rank that raises or dies turns into a ``RankFailedError`` carrying its
traceback, the other ranks are stopped (they may be waiting in a collective that
will never complete), and the backend refuses further work.

Ranks start with the ``spawn`` method by default (``fsdp.start_method``), so a script
that drives the backend directly needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from pydantic import ValidationError

from miles.config.schema import TrainSection
from miles.errors import ConfigError, ModelError
from miles.interfaces import BackendSpec, TransportStats
from miles.types import Sample, TrainBatch
from miles_fsdp.batching import check_batch, split_batch, split_for_scoring
from miles_fsdp.config import FSDPOptions

log = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 30.0
# After one rank reports an error, how long the others get to answer too. If they all do, no
# rank is stuck in a collective and the backend stays usable; if not, they are stopped.
_ERROR_GRACE_S = 5.0

# Imported once by the forkserver so each rank starts in milliseconds instead of re-importing them.
# None of them touches CUDA at import time, so forked ranks can still pick their own GPU.
_FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "miles_fsdp.rank",
]


class RankFailedError(RuntimeError):
    """A trainer rank raised, died or timed out; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


class FSDPBackend:
    """``miles.interfaces.Backend`` on PyTorch FSDP2; options come from the ``train`` and ``fsdp`` sections."""

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._broken: str | None = None
        self._finalizer: weakref.finalize | None = None
        self.spec: BackendSpec | None = None
        self.train_opts: TrainSection | None = None
        self.opts: FSDPOptions | None = None

    # ----------------------------------------------------------------- set-up

    def setup(self, spec: BackendSpec) -> None:
        if self._procs:
            raise RuntimeError("FSDPBackend.setup called twice; shut it down first")
        self.train_opts, self.opts = _validate_options(spec.options)
        _check_model_dir(spec.model_path, "model")
        if spec.temperature <= 0:
            raise ConfigError(
                f"fsdp: the rollout temperature must be > 0 to compute log-probs, got {spec.temperature}"
            )
        n = self.opts.num_ranks
        if self.opts.device == "cuda":
            import torch

            if torch.cuda.device_count() < n:
                raise ConfigError(
                    f"fsdp.num_ranks is {n} on device cuda but {torch.cuda.device_count()} GPU(s) are visible; "
                    "use one GPU per rank, or device: cpu"
                )
        from miles.plugins import validate_component_ref

        # Unknown names fail here, in one line, instead of as a traceback from every rank.
        validate_component_ref("loss", spec.loss)
        if spec.critic is not None:
            validate_component_ref("loss", spec.critic.loss)
            _check_model_dir(spec.critic.model_path, "critic")
        for path, role in ((spec.ref_model_path, "reference model"), (spec.teacher_model_path, "teacher")):
            if path is not None:
                _check_model_dir(path, role)
        if spec.correction:
            validate_component_ref("correction", spec.correction)
        if spec.engine_urls:
            from miles.plugins import make_component

            # Built (not connected) here too, so a wrong transport option is one clear error, not one per rank.
            make_component("transport", spec.transport, dict(spec.transport_options))
        self.spec = spec
        from miles_fsdp.worker import rank_main

        ctx = mp.get_context(self.opts.start_method)
        if self.opts.start_method == "forkserver":
            ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
        port = free_port()
        for rank in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(rank, n, port, child, spec, self.opts.command_timeout_s),
                name=f"miles-fsdp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)
        self._collect("start-up", self.opts.startup_timeout_s, expect="ready")
        log.info("fsdp: %d rank(s) ready on %s", n, self.opts.device)

    # ------------------------------------------------------------------ steps

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        assert self.opts is not None and self.train_opts is not None
        check_batch(batch)
        shares = split_batch(batch, self.opts.num_ranks, self.train_opts.micro_batch_size)
        results = self._run("train_step", shares)
        return results[0]

    def score(self, samples: list[Sample], names: list[str]) -> dict[str, list[list[float]]]:
        """Forward-only passes of the frozen scorers / critic; rows come back in ``samples`` order."""
        assert self.opts is not None and self.train_opts is not None
        if not names or not samples:
            return {name: [] for name in names}
        shares, layout = split_for_scoring(samples, self.opts.num_ranks, self.train_opts.micro_batch_size)
        results = self._run("score", [(share, list(names)) for share in shares])
        out: dict[str, list[list[float]]] = {name: [[] for _ in samples] for name in names}
        for rank_layout, rank_result in zip(layout, results, strict=True):
            for mb_indices, mb_rows in zip(rank_layout, rank_result, strict=True):
                for index, row in zip(mb_indices, mb_rows, strict=True):
                    for name in names:
                        out[name][index] = row[name]
        return out

    def update_weights(self, version: int) -> TransportStats:
        results = self._run("update_weights", [version] * len(self._procs))
        return results[0]

    def save_checkpoint(self, directory: str) -> None:
        directory = os.path.abspath(directory)
        os.makedirs(directory, exist_ok=True)
        self._run("save_checkpoint", [directory] * len(self._procs))

    def load_checkpoint(self, directory: str) -> None:
        from miles_fsdp.checkpoint import STATE_FILE

        directory = os.path.abspath(directory)
        if not os.path.isfile(os.path.join(directory, STATE_FILE)):
            raise FileNotFoundError(f"{directory} is not an FSDP checkpoint ({STATE_FILE} is missing)")
        self._run("load_checkpoint", [directory] * len(self._procs))

    def export_hf(self, directory: str) -> None:
        directory = os.path.abspath(directory)
        self._run("export_hf", [directory] * len(self._procs))

    def shutdown(self) -> None:
        if not self._procs:
            return
        for proc, conn in zip(self._procs, self._conns, strict=True):
            if proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(("shutdown", None))
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill_all(self._procs)
        for conn in self._conns:
            conn.close()
        if self._finalizer is not None:
            self._finalizer.detach()
        self._procs, self._conns = [], []
        self._broken = "shut down"

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids (for monitoring)."""
        return [p.pid for p in self._procs]

    # -------------------------------------------------------------- plumbing

    def _run(self, command: str, args: list[Any]) -> list[Any]:
        if self._broken is not None:
            raise RuntimeError(f"the FSDP backend cannot run {command}: it is {self._broken}")
        if not self._procs:
            raise RuntimeError(f"the FSDP backend cannot run {command}: setup() has not been called")
        assert self.opts is not None
        for rank, (conn, arg) in enumerate(zip(self._conns, args, strict=True)):
            try:
                conn.send((command, arg))
            except (BrokenPipeError, OSError) as exc:
                self._fail(rank, command, f"could not send the command: {exc}")
        return self._collect(command, self.opts.command_timeout_s, expect="ok")

    def _collect(self, what: str, timeout_s: float, *, expect: str) -> list[Any]:
        """Wait for one answer per rank.

        A crash or the deadline fails the backend. An error reply fails it too unless every
        other rank answers within a short grace period: then the ranks are still in step
        and the error is raised with the backend left usable.
        """
        results: list[Any] = [None] * len(self._procs)
        errors: dict[int, str] = {}
        grace_end = math.inf
        pending = set(range(len(self._procs)))
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if errors:
                remaining = min(remaining, grace_end - time.monotonic())
                if remaining <= 0:
                    first = min(errors)
                    self._fail(first, what, errors[first])
            if remaining <= 0:
                self._fail(min(pending), what, f"no answer within {timeout_s:.0f} s")
            waitables: dict[Any, int] = {}
            for r in pending:
                waitables[self._conns[r]] = r
                waitables[self._procs[r].sentinel] = r
            for ready in wait(list(waitables), timeout=remaining):
                r = waitables[ready]
                if r not in pending:
                    continue
                conn = self._conns[r]
                if conn.poll():
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        self._fail(r, what, self._death_note(r))
                    if kind == "error" and expect == "ready":
                        self._fail(r, what, payload)
                    if kind == "error":
                        if not errors:
                            grace_end = time.monotonic() + _ERROR_GRACE_S
                        errors[r] = payload
                        pending.discard(r)
                        continue
                    if kind != expect:
                        self._fail(r, what, f"unexpected answer {kind!r}")
                    results[r] = payload
                    pending.discard(r)
                elif not self._procs[r].is_alive():
                    self._fail(r, what, self._death_note(r))
        if errors:
            first = min(errors)
            raise RankFailedError(
                f"fsdp rank {first} failed during {what} (every rank answered; the backend is still usable):\n"
                f"{errors[first].rstrip()}"
            )
        return results

    def _death_note(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=1)
        return f"the rank process exited (exit code {proc.exitcode}) without an answer"

    def _fail(self, rank: int, what: str, detail: str) -> None:
        self._broken = f"broken (rank {rank} failed during {what})"
        _kill_all(self._procs)
        raise RankFailedError(f"fsdp rank {rank} failed during {what}:\n{detail.rstrip()}")


def _check_model_dir(path: str, role: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelError(f"fsdp: {role} path {path!r} is not a Hugging Face model directory (no config.json)")


def _validate_options(options: dict[str, Any]) -> tuple[TrainSection, FSDPOptions]:
    try:
        train = TrainSection.model_validate(options.get("train", {}))
        fsdp = FSDPOptions.model_validate(options.get("fsdp", {}))
    except ValidationError as exc:
        raise ConfigError(f"fsdp backend options are invalid: {exc}") from exc
    unknown = set(options) - {"train", "fsdp"}
    if unknown:
        raise ConfigError(f"fsdp backend options: unknown section(s) {sorted(unknown)}; allowed: train, fsdp")
    return train, fsdp
