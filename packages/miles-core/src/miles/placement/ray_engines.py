"""Rollout engines as Ray actors: one placement group bundle and one actor per engine.

Each actor is a small host for one engine *process*: it picks a free port on its node,
starts the command the wrapped launcher would run locally (``EmbeddedLauncher.command``
or SGLang's ``launch_server``), waits for ``/health`` and hands back the URL. The engine
binds to the node's address (127.0.0.1 on a single-machine cluster), and inherits the
actor's ``CUDA_VISIBLE_DEVICES``, so it uses exactly the GPU Ray reserved for its bundle.

Engines that are attached to (every spec has an ``url`` option) never touch Ray: the
wrapped launcher handles them as it does without Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.capabilities import EngineCapabilities, engine_capabilities
from miles.engines.launchers import SGLangLauncher, _ProcessLauncher, free_port
from miles.errors import ConfigError, EngineError
from miles.interfaces import EngineClient, EngineLauncher, EngineSpec
from miles.placement.ray_cluster import (
    bundle_actor_options,
    import_ray,
    placement_group_for,
    remove_placement_group,
)

log = logging.getLogger(__name__)

_STOP_GRACE_S = 20.0
_ACTOR_START_S = 60.0  # on top of the engines' start-up limit: scheduling and starting the actors


class RayEngineLauncher:
    """``miles.interfaces.EngineLauncher`` that runs ``inner``'s engines on a Ray cluster.

    ``inner`` is the launcher the recipe names (``embedded`` or ``sglang``); ``bundle`` is the
    Ray resources of one engine (``placement.engine_bundle``, e.g. ``{"GPU": 1}``). Ray must be
    initialised (see :func:`miles.placement.ray_cluster.ray_session`).
    """

    def __init__(
        self, inner: EngineLauncher, bundle: Mapping[str, float], *, name: str = "miles-engines"
    ) -> None:
        if not isinstance(inner, _ProcessLauncher):
            raise ConfigError(
                f"placement.launcher 'ray' runs engines that Miles launches as processes (embedded, sglang); "
                f"{type(inner).__name__} is not one"
            )
        self.inner = inner
        self.bundle = dict(bundle)
        self.name = name
        self._group: Any = None
        self._actors: list[Any] = []
        self._attached = False

    def launch(self, specs: list[EngineSpec], log_dir: str) -> list[str]:
        if any("url" in s.options for s in specs):
            # Attaching to running servers: nothing to place, so no Ray at all.
            self._attached = True
            return self.inner.launch(specs, log_dir)
        self.inner._check_options(specs)
        if not specs:
            return []
        if self._actors:
            raise RuntimeError("RayEngineLauncher.launch called twice; shut it down first")
        ray = import_ray()
        if not ray.is_initialized():
            raise ConfigError("RayEngineLauncher needs a Ray connection; run it inside ray_session()")
        timeout = float(specs[0].options.get("startup_timeout_s") or self.inner.startup_timeout_s)
        self._group = placement_group_for([self.bundle] * len(specs), self.name, "PACK")
        try:
            host_cls = ray.remote(EngineHost)
            self._actors = [
                host_cls.options(**bundle_actor_options(self._group, i, self.bundle)).remote()
                for i in range(len(specs))
            ]
            prefix = "sglang" if isinstance(self.inner, SGLangLauncher) else "engine"
            log_dir = os.path.abspath(log_dir)
            refs = [
                actor.start.remote(
                    type(self.inner), spec, os.path.join(log_dir, f"{prefix}-{i}.log"), timeout
                )
                for i, (actor, spec) in enumerate(zip(self._actors, specs, strict=True))
            ]
            urls = self._wait_started(ray, refs, timeout + _ACTOR_START_S)
        except BaseException:
            self.shutdown()
            raise
        log.info("ray: %d engine(s) up: %s", len(urls), ", ".join(urls))
        return urls

    def _wait_started(self, ray: Any, refs: list[Any], timeout_s: float) -> list[str]:
        """Each engine's URL; the first failure (with its engine's log tail) ends the launch at once."""
        urls: dict[Any, str] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise EngineError(f"{len(pending)} Ray engine actor(s) did not start within {timeout_s:g} s")
            try:
                urls[ready[0]] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, EngineError) else EngineError(str(exc))) from None
            except ray.exceptions.RayActorError as exc:
                raise EngineError(f"a Ray engine actor died while starting its engine: {exc}") from None
        return [urls[ref] for ref in refs]

    @property
    def pids(self) -> list[int]:
        """The engine processes' ids (on their nodes)."""
        ray = import_ray()
        return [pid for actor in self._actors for pid in ray.get(actor.pids.remote(), timeout=30)]

    @property
    def capabilities(self) -> EngineCapabilities:
        return engine_capabilities(self.inner)  # the same engines, placed by Ray

    def client(self, url: str) -> EngineClient:
        return self.inner.client(url)

    def shutdown(self) -> None:
        """Stop the engine processes, then their actors, then give the bundles back."""
        if self._attached:
            self.inner.shutdown()
        actors, self._actors = self._actors, []
        group, self._group = self._group, None
        if not actors and group is None:
            return
        ray = import_ray()
        if ray.is_initialized():
            refs = [actor.stop.remote() for actor in actors]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=_STOP_GRACE_S)
            for actor in actors:
                try:
                    ray.kill(actor)
                except Exception as exc:  # already dead
                    log.debug("ray.kill of an engine actor: %s", exc)
        remove_placement_group(group)


class EngineHost:
    """The Ray actor behind one engine: starts its process on this node and stops it.

    Plain class (``ray.remote`` is applied when launching) so importing this module needs no Ray.
    """

    def __init__(self) -> None:
        self._launcher: _ProcessLauncher | None = None

    def start(
        self, launcher_cls: type[_ProcessLauncher], spec: EngineSpec, log_path: str, timeout_s: float
    ) -> str:
        import ray

        host = ray.util.get_node_ip_address()
        if not Path(spec.model_path).is_dir():
            raise EngineError(f"engine model path {spec.model_path!r} is not a directory on node {host}")
        handoff = spec.options.get("handoff_dir")
        if handoff is not None:
            Path(handoff).mkdir(parents=True, exist_ok=True)
        port = spec.port if spec.port is not None else free_port(host)
        on_node = dataclasses.replace(spec, host=host, port=port)
        # A launcher built here: its command runs this node's interpreter, and names this actor as
        # the engine's parent (an engine exits when its parent is gone, so a killed actor leaves none).
        launcher = launcher_cls(startup_timeout_s=timeout_s)
        self._launcher = launcher
        argv = launcher.command(on_node, port)
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        started = time.monotonic()
        launcher._launch_all([(argv, url, Path(log_path), spec.options.get("env"))], timeout_s)
        log.info("engine %s healthy after %.1f s", url, time.monotonic() - started)
        return url

    def pids(self) -> list[int]:
        return [] if self._launcher is None else self._launcher.pids

    def stop(self) -> None:
        if self._launcher is not None:
            self._launcher.shutdown()
