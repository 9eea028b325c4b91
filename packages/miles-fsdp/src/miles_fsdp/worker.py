"""The body of one rank process: join the process group, build the trainer, serve commands.

The driver talks to each rank over its own ``multiprocessing`` pipe (local IPC
between our own processes). Protocol: the rank sends ``("ready", info)`` once
built; then for every ``(command, arg)`` it receives it answers ``("ok", result)``
or ``("error", traceback_text)``. ``("shutdown", None)`` ends the loop. Any
exception is reported with its traceback; the driver decides what happens next.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from miles.interfaces import BackendSpec


def rank_main(
    rank: int, world_size: int, port: int, conn: Connection, spec: BackendSpec, timeout_s: float
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    # The driver already reported broken plugins once; ranks stay quiet about them.
    logging.getLogger("miles.plugins").setLevel(logging.ERROR)
    trainer = None
    try:
        import torch
        import torch.distributed as dist

        threads = spec.options.get("fsdp", {}).get("torch_threads") or int(
            os.environ.get("MILES_TORCH_THREADS", "0") or 0
        )
        if threads:
            torch.set_num_threads(int(threads))
        device = spec.options.get("fsdp", {}).get("device", "cpu")
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", rank) if device == "cuda" else None,
        )
        from miles_fsdp.rank import RankTrainer

        trainer = RankTrainer(spec, rank, world_size)
        conn.send(("ready", {"pid": os.getpid()}))
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        return

    try:
        _serve(conn, trainer)
    finally:
        try:
            trainer.close()
        finally:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


COMMANDS = frozenset(
    {"train_step", "score", "update_weights", "save_checkpoint", "load_checkpoint", "export_hf"}
)


def _serve(conn: Connection, trainer: Any) -> None:
    while True:
        try:
            command, arg = conn.recv()
        except (EOFError, OSError):
            return  # the driver went away: nothing left to serve
        if command == "shutdown":
            _send(conn, ("ok", None))
            return
        if command not in COMMANDS:
            _send(conn, ("error", f"unknown command {command!r}; known: {sorted(COMMANDS)}"))
            continue
        try:
            result = getattr(trainer, command)(arg)
        except BaseException:
            _send(conn, ("error", traceback.format_exc()))
            continue
        _send(conn, ("ok", result))


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):
        conn.send(message)
