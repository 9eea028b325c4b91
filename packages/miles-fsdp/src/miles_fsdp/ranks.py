"""The trainer's rank group: N ranks that each run the same command, one answer per rank.

:class:`RankGroup` holds what every way of running ranks shares: sending a command with
one argument per rank, collecting the answers under a deadline, and the failure rules.
A rank that raises, dies or misses the deadline turns into a :class:`RankFailedError`
carrying its traceback (or how it died); the other ranks are then stopped, since they may
be waiting in a collective that will never complete, and the group refuses further work.
If every other rank answers within a short grace period after an error, no rank is stuck,
so the error is raised with the group left usable.

Two implementations: :class:`ProcessRanks` (local processes and pipes, the default) here,
and ``RayRanks`` (Ray actors in a placement group) in ``ray_ranks.py``.
"""

from __future__ import annotations

import abc
import contextlib
import math
import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from miles.interfaces import BackendSpec

# After one rank reports an error, how long the others get to answer too.
ERROR_GRACE_S = 5.0
SHUTDOWN_GRACE_S = 30.0

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

Event = tuple[int, str, Any]  # (rank, "ready" | "ok" | "error" | "dead", payload)


class RankFailedError(RuntimeError):
    """A trainer rank raised, died or timed out; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup(abc.ABC):
    """The ranks of one backend. Subclasses say how to start, post to, hear from and stop them."""

    def __init__(self, size: int, command_timeout_s: float) -> None:
        self.size = size
        self.command_timeout_s = command_timeout_s
        self.broken: str | None = None

    # ------------------------------------------------------------- interface

    def send(self, command: str, args: list[Any]) -> list[Any]:
        """Run ``command`` on every rank (``args[r]`` for rank ``r``); their results in rank order."""
        if self.broken is not None:
            raise RuntimeError(f"the FSDP backend cannot run {command}: it is {self.broken}")
        if len(args) != self.size:
            raise ValueError(f"{command}: {len(args)} arguments for {self.size} ranks")
        for rank, arg in enumerate(args):
            problem = self._post(rank, command, arg)
            if problem is not None:
                self._fail(rank, command, f"could not send the command: {problem}")
        return self._collect(command, self.command_timeout_s, expect="ok")

    def wait_ready(self, timeout_s: float) -> list[Any]:
        """Wait until every rank has built its trainer (an error here always fails the group)."""
        return self._collect("start-up", timeout_s, expect="ready")

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the ranks cleanly (they close their trainers), killing those that do not stop in time."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop every rank now (no clean-up on their side)."""

    @property
    @abc.abstractmethod
    def pids(self) -> list[int]:
        """The rank processes' ids (for monitoring; with Ray, on their nodes)."""

    # ---------------------------------------------------------- for subclasses

    @abc.abstractmethod
    def _post(self, rank: int, command: str, arg: Any) -> str | None:
        """Hand ``(command, arg)`` to a rank; a description of the problem if it cannot be delivered."""

    @abc.abstractmethod
    def _events(self, pending: set[int], timeout_s: float) -> list[Event]:
        """Answers (or deaths) of ``pending`` ranks that arrive within ``timeout_s``; may be empty."""

    # --------------------------------------------------------------- shared

    def _collect(self, what: str, timeout_s: float, *, expect: str) -> list[Any]:
        results: list[Any] = [None] * self.size
        errors: dict[int, str] = {}
        grace_end = math.inf
        pending = set(range(self.size))
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
            for rank, kind, payload in self._events(pending, remaining):
                if rank not in pending:
                    continue
                if kind == "dead" or (kind == "error" and expect == "ready"):
                    self._fail(rank, what, payload)
                if kind == "error":
                    if not errors:
                        grace_end = time.monotonic() + ERROR_GRACE_S
                    errors[rank] = payload
                    pending.discard(rank)
                    continue
                if kind != expect:
                    self._fail(rank, what, f"unexpected answer {kind!r}")
                results[rank] = payload
                pending.discard(rank)
        if errors:
            first = min(errors)
            raise RankFailedError(
                f"fsdp rank {first} failed during {what} (every rank answered; the backend is still usable):\n"
                f"{errors[first].rstrip()}"
            )
        return results

    def _fail(self, rank: int, what: str, detail: str) -> None:
        self.broken = f"broken (rank {rank} failed during {what})"
        self.kill()
        raise RankFailedError(f"fsdp rank {rank} failed during {what}:\n{detail.rstrip()}")


class ProcessRanks(RankGroup):
    """Ranks as local processes (``spawn`` or ``forkserver``), one pipe each."""

    def __init__(
        self,
        spec: BackendSpec,
        size: int,
        *,
        start_method: Literal["spawn", "forkserver"],
        command_timeout_s: float,
        trainer_factory: str | None = None,
    ) -> None:
        """``trainer_factory``: what each rank builds (see :func:`miles_fsdp.worker.start_rank`)."""
        super().__init__(size, command_timeout_s)
        from miles_fsdp.worker import rank_main

        ctx = mp.get_context("spawn") if start_method == "spawn" else mp.get_context("forkserver")
        if start_method == "forkserver":
            ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
        port = free_port()
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(rank, size, port, child, spec, command_timeout_s, trainer_factory),
                name=f"miles-fsdp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _post(self, rank: int, command: str, arg: Any) -> str | None:
        try:
            self._conns[rank].send((command, arg))
        except (BrokenPipeError, OSError) as exc:
            return str(exc)
        return None

    def _events(self, pending: set[int], timeout_s: float) -> list[Event]:
        waitables: dict[Any, int] = {}
        for r in pending:
            waitables[self._conns[r]] = r
            waitables[self._procs[r].sentinel] = r
        events: list[Event] = []
        seen: set[int] = set()
        for ready in wait(list(waitables), timeout=timeout_s):
            r = waitables[ready]
            if r in seen:
                continue
            conn = self._conns[r]
            if conn.poll():  # an answer first, even if the process has exited since
                seen.add(r)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    events.append((r, "dead", self._death_note(r)))
                    continue
                events.append((r, kind, payload))
            elif not self._procs[r].is_alive():
                seen.add(r)
                events.append((r, "dead", self._death_note(r)))
        return events

    def _death_note(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=1)
        return f"the rank process exited (exit code {proc.exitcode}) without an answer"

    def close(self) -> None:
        for proc, conn in zip(self._procs, self._conns, strict=True):
            if proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(("shutdown", None))
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()
        for conn in self._conns:
            conn.close()
        self.broken = "shut down"

    def kill(self) -> None:
        _kill_all(self._procs)


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
