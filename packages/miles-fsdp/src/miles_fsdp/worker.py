"""The body of one trainer rank, wherever it runs: join the process group, build the trainer, serve commands.

Two hosts run this code: a local process started by ``ProcessRanks`` (this module's
``rank_main``, talking over a ``multiprocessing`` pipe) and a Ray actor started by
``RayRanks`` (``ray_ranks.py``). Both build the rank with :func:`start_rank` and answer
every command through :meth:`RankCommands.run`, so the command set and the trainer's
construction exist once.

Pipe protocol: the rank sends ``("ready", info)`` once built; then for every
``(command, arg)`` it receives it answers ``("ok", result)`` or ``("error",
traceback_text)``. ``("shutdown", None)`` ends the loop. Any exception is reported with
its traceback; the driver decides what happens next.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from miles.interfaces import BackendSpec

# The trainer methods a driver may call, plus the offload pair (see ``offload.py``).
TRAINER_COMMANDS = frozenset(
    {
        "train_step",
        "train_adapters",
        "unsent_adapters",
        "score",
        "loss_kind",
        "update_weights",
        "reconnect_transport",
        "save_checkpoint",
        "load_checkpoint",
        "export_hf",
        "optimizer_state_bytes",
    }
)
COMMANDS = TRAINER_COMMANDS | {"offload", "onload"}

Reply = tuple[str, Any]  # ("ready" | "ok" | "error", payload)


class RankCommands:
    """One built rank: runs a named command and turns any exception into an error reply."""

    def __init__(self, trainer: Any) -> None:
        from miles_fsdp.offload import Offloader

        self.trainer = trainer
        self.offloader = Offloader(trainer)

    def run(self, command: str, arg: Any) -> Reply:
        if command not in COMMANDS:
            return "error", f"unknown command {command!r}; known: {sorted(COMMANDS)}"
        target = self.offloader if command in ("offload", "onload") else self.trainer
        try:
            return "ok", getattr(target, command)(arg)
        except BaseException:
            return "error", traceback.format_exc()

    def close(self) -> None:
        try:
            self.trainer.close()
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def start_rank(
    spec: BackendSpec,
    rank: int,
    world_size: int,
    master: tuple[str, int],
    timeout_s: float,
    device_index: int | None = None,
    trainer_factory: str | None = None,
) -> RankCommands:
    """Join the default process group and build this rank's trainer.

    ``trainer_factory``: an import path (``pkg.module:attr``) to a callable taking ``(spec, rank,
    world_size, device_index=...)`` that builds the rank's trainer instead of miles-fsdp's own
    :class:`~miles_fsdp.rank.RankTrainer` (another backend reusing these ranks: miles-diffusion's).

    ``master`` is rank 0's (address, port) for the rendezvous. ``device_index`` is the CUDA
    device this rank uses (default: its rank, one GPU per rank on one machine; a Ray actor
    sees only the GPU Ray gave it, so its index is 0).
    """
    addr, port = master
    os.environ.update(
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank if device_index is None else device_index),
        WORLD_SIZE=str(world_size),
    )
    # The driver already reported broken plugins once; ranks stay quiet about them.
    logging.getLogger("miles.plugins").setLevel(logging.ERROR)
    import torch
    import torch.distributed as dist

    fsdp_opts = spec.options.get("fsdp", {})
    threads = fsdp_opts.get("torch_threads") or int(os.environ.get("MILES_TORCH_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(int(threads))
    cuda = fsdp_opts.get("device", "cpu") == "cuda"
    index = rank if device_index is None else device_index
    if cuda:
        torch.cuda.set_device(index)
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=torch.device("cuda", index) if cuda else None,
    )
    if trainer_factory is not None:
        import importlib

        module, _, attr = trainer_factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        return RankCommands(factory(spec, rank, world_size, device_index=index))
    from miles_fsdp.rank import RankTrainer

    return RankCommands(RankTrainer(spec, rank, world_size, device_index=index))


def rank_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    spec: BackendSpec,
    timeout_s: float,
    trainer_factory: str | None = None,
) -> None:
    """A local rank process: build, say ready, serve the pipe until shutdown or until the driver goes."""
    # The terminal's Ctrl-C reaches the whole process group; the driver decides when ranks stop
    # (it finishes the step first), so a rank must not die of it mid-collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        commands = start_rank(
            spec, rank, world_size, ("127.0.0.1", port), timeout_s, trainer_factory=trainer_factory
        )
        conn.send(("ready", {"pid": os.getpid()}))
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        return
    try:
        _serve(conn, commands)
    finally:
        commands.close()


def _serve(conn: Connection, commands: RankCommands) -> None:
    while True:
        try:
            command, arg = conn.recv()
        except (EOFError, OSError):
            return  # the driver went away: nothing left to serve
        if command == "shutdown":
            _send(conn, ("ok", None))
            return
        _send(conn, commands.run(command, arg))


def _send(conn: Connection, message: Reply) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):
        conn.send(message)
