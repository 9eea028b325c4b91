"""The multi-rank launch: one spawned process per megatron rank, each a ``MegatronTrainer``.

``megatron.num_ranks`` processes are forked by ``multiprocessing``'s forkserver, which imports
torch and megatron-core once (none touches CUDA at import, so each rank still
picks its own GPU); a rank then starts without re-importing them. (A plain fork of the driver
is not safe: a child forked after the driver used gloo crashed with SIGSEGV.) Rank ``r`` joins the process group at a
TCP rendezvous on this host and builds its trainer. Every trainer
method is a collective, so :class:`TrainerRanks` sends each command to every rank with the same
arguments and returns rank 0's answer (TP ranks compute the same losses and log-probs).

Pipe protocol, per rank: ``("ready", pid)`` once built (or ``("error", traceback)``); then one
``("ok", result)`` or ``("error", traceback)`` for every ``(command, args)``; ``("close", ())``
closes the trainer and ends the process. A rank that raises or dies fails the command with its
traceback; the other ranks are then killed (they may wait in a collective forever) and the
group refuses further commands.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

from miles.config.schema import TrainSection
from miles.interfaces import BackendSpec
from miles_megatron.config import MegatronOptions
from miles_megatron.convert import Spec
from miles_megatron.layout import ParallelLayout

COMMANDS = frozenset(
    {
        "loss_kind",
        "train_step",
        "unsent_adapters",
        "score",
        "update_weights",
        "export_hf",
        "save_checkpoint",
        "load_checkpoint",
        "offload",
        "onload",
    }
)


# Imported once by the forkserver, inherited by every rank it forks.
_PRELOAD = [
    "torch",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "miles_megatron.cpu",
    "miles_megatron.trainer",
]


class RankError(RuntimeError):
    """A megatron rank raised, died or missed the deadline; the message carries its traceback."""


def _rank_main(
    rank: int,
    conn: Connection,
    init_method: str,
    spec: BackendSpec,
    layout: ParallelLayout,
    options: MegatronOptions,
    train: TrainSection,
    layer_spec: Spec,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when ranks stop
    import torch

    if options.device == "cpu":  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world))
    try:
        from miles_megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer(
            spec, layout, options, train, layer_spec, rank=rank, init_method=init_method
        )
        conn.send(("ready", os.getpid()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                command, args = conn.recv()
            except (EOFError, OSError):
                return  # the driver is gone
            if command == "close":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(trainer, command)(*args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        trainer.close()


class TrainerRanks:
    """``layout.world`` trainer ranks in spawned processes, driven like one ``MegatronTrainer``."""

    def __init__(
        self,
        spec: BackendSpec,
        layout: ParallelLayout,
        options: MegatronOptions,
        train: TrainSection,
        layer_spec: Spec,
        *,
        startup_timeout_s: float = 600.0,
        command_timeout_s: float = 3600.0,
    ) -> None:
        from miles_megatron.trainer import free_port

        self.world = layout.world
        self.command_timeout_s = command_timeout_s
        self.broken: str | None = None
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        init = f"tcp://127.0.0.1:{free_port()}"
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        for rank in range(layout.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, child, init, spec, layout, options, train, layer_spec),
                name=f"miles-megatron-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start", startup_timeout_s, expect="ready")

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def call(self, command: str, *args: Any) -> list[Any]:
        """Run ``command(*args)`` on every rank; their answers, by rank."""
        if command not in COMMANDS:
            raise ValueError(f"unknown megatron rank command {command!r}; known: {sorted(COMMANDS)}")
        if self.broken is not None:
            raise RankError(f"the megatron ranks cannot run {command}: {self.broken}")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((command, args))
            except (BrokenPipeError, OSError) as exc:
                self._fail(f"rank {rank} could not be sent {command}: {exc}")
        return self._collect(command, self.command_timeout_s, expect="ok")

    def __getattr__(self, command: str) -> Any:
        if command not in COMMANDS:
            raise AttributeError(command)
        return lambda *args: self.call(command, *args)[0]

    def _collect(self, what: str, timeout_s: float, *, expect: str) -> list[Any]:
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < self.world:
            pending = [r for r in range(self.world) if r not in answers]
            waitables = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            ready = wait(list(waitables), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(f"{what}: rank(s) {pending} did not answer within {timeout_s:.0f} s")
            for handle in ready:
                r = waitables[handle]
                if r in answers:
                    continue
                conn = self._conns[r]
                if conn.poll():
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        self._procs[r].join(timeout=5)
                        self._fail(
                            f"{what}: rank {r} exited (code {self._procs[r].exitcode}) without an answer"
                        )
                    if kind != expect:
                        self._fail(f"{what} failed on rank {r}:\n{payload}")
                    answers[r] = payload
                elif not self._procs[r].is_alive():
                    self._fail(f"{what}: rank {r} exited (code {self._procs[r].exitcode}) without an answer")
        return [answers[r] for r in range(self.world)]

    def _fail(self, message: str) -> None:
        self.broken = message.splitlines()[0]
        self._kill()
        raise RankError(message)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)

    def close(self) -> None:
        """Close every rank's trainer (the process group with it) and end the processes."""
        if self.broken is None:
            for conn in self._conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(("close", ()))
            deadline = time.monotonic() + 30.0
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        for conn in self._conns:
            conn.close()
        self.broken = "closed"
