"""Trainer ranks as Ray actors: one placement group, one bundle and one actor per rank.

Each actor runs the same rank code as a local rank process (``worker.start_rank`` and
``RankCommands``); only the transport of commands differs: an actor method call per
command instead of a pipe message. Rank 0's actor picks the rendezvous address (its
node's IP and a free port there), every actor joins the process group with it (gloo on
CPU, NCCL on CUDA), and on a GPU bundle each actor sees exactly the GPU Ray reserved for
it (``CUDA_VISIBLE_DEVICES``), which is therefore its device 0.

Actors see the driver's ``sys.path`` too (appended where missing), as spawned processes
do, so components named by import path resolve the same way on both launchers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
from collections.abc import Mapping
from typing import Any

from miles.errors import ConfigError
from miles.interfaces import BackendSpec
from miles_fsdp.ranks import SHUTDOWN_GRACE_S, Event, RankGroup

GROUP_NAME = "miles-trainer"


def trainer_bundle(placement: Mapping[str, Any], device: str) -> dict[str, float]:
    """The Ray resources of one rank: ``placement["bundle"]``, or one GPU (cuda) / one CPU.

    A rank drives exactly one GPU: a whole one, or a fraction of one that it shares with
    engines on a colocated placement (``{"GPU": 0.5}``); never more.
    """
    from miles.placement.ray_cluster import default_bundle

    bundle = dict(placement.get("bundle") or default_bundle(device))
    gpus = float(bundle.get("GPU", 0))
    if device == "cuda" and not 0 < gpus <= 1:
        raise ConfigError(
            f"fsdp.device is cuda with placement.launcher ray, so each rank needs one GPU (or a share of one, "
            f"when colocated with engines) in placement.trainer_bundle; got {bundle}"
        )
    return bundle


class RayRanks(RankGroup):
    """The backend's ranks as actors in the ``miles-trainer`` placement group."""

    def __init__(
        self,
        spec: BackendSpec,
        size: int,
        *,
        bundle: Mapping[str, float],
        command_timeout_s: float,
        startup_timeout_s: float,
    ) -> None:
        super().__init__(size, command_timeout_s)
        from miles.placement.ray_cluster import (
            bundle_actor_options,
            import_ray,
            placement_group_for,
            ray_session,
        )

        self._ray = ray = import_ray()
        self._actors: list[Any] = []
        self._inflight: dict[int, Any] = {}
        self._group: Any = None
        self._ready: list[dict[str, Any]] = []
        # The driver normally holds the Ray connection for the whole run (ray_session around it);
        # a backend used on its own opens one for its lifetime.
        self._session = contextlib.ExitStack()
        try:
            if not ray.is_initialized():
                self._session.enter_context(ray_session(spec.placement.get("ray_address")))
            self._group = placement_group_for(
                [dict(bundle)] * size, GROUP_NAME, "PACK", timeout_s=min(startup_timeout_s, 120.0)
            )
            actor_cls = ray.remote(RankActor)
            self._actors = [
                actor_cls.options(**bundle_actor_options(self._group, rank, bundle)).remote(list(sys.path))
                for rank in range(size)
            ]
            try:
                master = ray.get(self._actors[0].rendezvous.remote(), timeout=startup_timeout_s)
            except ray.exceptions.RayError as exc:
                self._fail(0, "start-up", f"the rank 0 actor did not start: {exc}")
            device_index = 0 if spec.options.get("fsdp", {}).get("device") == "cuda" else None
            for rank, actor in enumerate(self._actors):
                self._inflight[rank] = actor.start.remote(
                    spec, rank, size, tuple(master), command_timeout_s, device_index
                )
        except BaseException:
            self.kill()
            raise

    def wait_ready(self, timeout_s: float) -> list[Any]:
        self._ready = super().wait_ready(timeout_s)
        return self._ready

    @property
    def pids(self) -> list[int]:
        return [int(info["pid"]) for info in self._ready]

    def _post(self, rank: int, command: str, arg: Any) -> str | None:
        # Never raises for a dead actor: the answer's reference carries the error instead.
        self._inflight[rank] = self._actors[rank].call.remote(command, arg)
        return None

    def _events(self, pending: set[int], timeout_s: float) -> list[Event]:
        ray = self._ray
        refs = {self._inflight[r]: r for r in pending}
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout_s)
        if ready:  # take every answer that is already there, not just the first
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        events: list[Event] = []
        for ref in ready:
            rank = refs[ref]
            try:
                kind, payload = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                events.append((rank, "dead", f"the rank actor died without an answer: {exc}"))
            except ray.exceptions.RayError as exc:
                events.append((rank, "dead", f"the rank actor failed: {exc}"))
            else:
                events.append((rank, kind, payload))
        return events

    def close(self) -> None:
        ray = self._ray
        if self._actors and ray.is_initialized():
            refs = [actor.stop.remote() for actor in self._actors]
            ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_GRACE_S)
        self.kill()
        self.broken = "shut down"

    def kill(self) -> None:
        from miles.placement.ray_cluster import remove_placement_group

        ray = self._ray
        actors, self._actors = self._actors, []
        if ray.is_initialized():
            for actor in actors:
                with contextlib.suppress(Exception):  # already dead
                    ray.kill(actor)
        group, self._group = self._group, None
        remove_placement_group(group)
        self._session.close()


class RankActor:
    """The Ray actor of one rank (``ray.remote`` is applied by :class:`RayRanks`, so no Ray at import)."""

    def __init__(self, driver_sys_path: list[str]) -> None:
        for entry in driver_sys_path:
            if entry and entry not in sys.path and os.path.isdir(entry):
                sys.path.append(entry)
        self.commands: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it, for the process group's store (rank 0 only)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, int(s.getsockname()[1])

    def start(
        self,
        spec: BackendSpec,
        rank: int,
        size: int,
        master: tuple[str, int],
        timeout_s: float,
        device_index: int | None,
    ) -> tuple[str, Any]:
        import ray

        from miles_fsdp.worker import start_rank

        try:
            self.commands = start_rank(spec, rank, size, master, timeout_s, device_index)
        except BaseException:
            return "error", traceback.format_exc()
        return "ready", {"pid": os.getpid(), "node": ray.util.get_node_ip_address()}

    def call(self, command: str, arg: Any) -> tuple[str, Any]:
        if self.commands is None:
            return "error", f"rank actor got {command!r} before it was started"
        return self.commands.run(command, arg)

    def stop(self) -> None:
        if self.commands is not None:
            commands, self.commands = self.commands, None
            commands.close()
