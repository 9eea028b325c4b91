"""The processes a run talks to: rollout engines and the trainer's ranks.

Both are context managers so that an error or Ctrl-C anywhere in the loop stops
every process the run started.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from miles import hookimpl
from miles.capabilities import (
    EnginePrep,
    EngineSetup,
    engine_capabilities,
    resolved_placement,
    shares_devices,
)
from miles.config.schema import MilesConfig
from miles.driver.objective import Objective
from miles.errors import ConfigError, EngineError
from miles.interfaces import Backend, BackendSpec, EngineLauncher, EngineSpec, TransportStats
from miles.plugins import load_component, make_component
from miles.routing import records_routing
from miles.types import TrainBatch


@contextlib.contextmanager
def rollout_engines(
    config: MilesConfig,
    model_path: str,
    log_dir: str,
    work_dir: str,
    on_launched: Callable[[EngineLauncher], None] | None = None,
) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Launch (or attach to) the engines; yields their URLs and the transport options they imply.

    ``on_launched`` gets the launcher once the engines are up (the fleet restarts engines with it).
    """
    eng = config.engine
    ws = config.weight_sync
    transport_options: dict[str, Any] = {"bucket_mb": ws.bucket_mb, **ws.options}
    if ws.check_equal:
        transport_options.update(check_equal=True, check_mode=ws.check_mode, check_skip=list(ws.check_skip))
    with contextlib.ExitStack() as stack:
        options: dict[str, Any] = {
            "device": eng.device,
            "dtype": eng.dtype or config.model.dtype,
            "max_batch_size": eng.max_batch_size,
            "startup_timeout_s": eng.startup_timeout_s,
            # Reproducible sampling unless engine.options overrides it (null: no seed). A running
            # server's seed was fixed when it started, so only engines this run starts get it.
            **({} if eng.urls else {"seed": config.run.seed}),
            **eng.options,
        }
        launcher: EngineLauncher = make_component("engine", eng.launcher)
        capture = engine_capabilities(launcher).routing_capture
        if records_routing(config) and capture and not eng.urls:
            # What the engine kind needs to return MoE routing (the pre-flight refused a kind that cannot).
            # Attached servers were configured when they started.
            options.update(dict(capture))
        # The transport says what its engine-side receiver needs (a hand-off directory, a delta
        # directory, flat buckets): options for the engines, and the matching ones for itself.
        prepare = getattr(load_component("transport", config.transport), "prepare_engines", None)
        if prepare is not None:
            setup = EngineSetup(
                engine=engine_capabilities(launcher),
                engine_dtype=options["dtype"],
                work_dir=work_dir,
                options=dict(ws.options),
                stack=stack,
            )
            prep: EnginePrep = prepare(setup)
            options.update(prep.engine_options)
            transport_options.update(prep.transport_options)
        if config.placement.launcher == "ray" and not eng.urls:
            from miles.placement import RayEngineLauncher, default_bundle

            launcher = RayEngineLauncher(
                launcher, config.placement.engine_bundle or default_bundle(eng.device)
            )
        stack.callback(launcher.shutdown)
        if eng.urls:
            specs = [
                EngineSpec(model_path=model_path, host=eng.host, options={**options, "url": u})
                for u in eng.urls
            ]
        else:
            specs = [
                EngineSpec(
                    model_path=model_path,
                    host=eng.host,
                    port=None if eng.port is None else eng.port + i,
                    options=options,
                )
                for i in range(eng.num_engines)
            ]
        urls = launcher.launch(specs, log_dir)
        if len(urls) != eng.num_engines:
            raise EngineError(
                f"launcher {eng.launcher!r} started {len(urls)} engines, expected {eng.num_engines}"
            )
        if on_launched is not None:
            on_launched(launcher)
        yield urls, transport_options


@contextlib.contextmanager
def trainer(
    config: MilesConfig,
    model_path: str,
    objective: Objective,
    engine_urls: list[str],
    transport_options: dict[str, Any],
    hooks_pm: Any,
) -> Iterator[Backend]:
    """Start the backend's ranks and plug its training step into the ``miles_train_step`` hook."""
    alg = config.algorithm
    options: dict[str, Any] = {"train": config.train.model_dump()}
    section = getattr(config, config.backend, None)
    if section is not None and hasattr(section, "model_dump"):
        options[config.backend] = section.model_dump()
    rl = config.mode == "rl"
    spec = BackendSpec(
        model_path=model_path,
        loss=objective.loss,
        # A correction compares with rollout log-probs; supervised data has none.
        correction=alg.correction if rl else None,
        transport=config.transport,
        engine_urls=engine_urls,
        # Log-probs at the sampling temperature for RL; the plain likelihood for SFT.
        temperature=config.rollout.temperature if rl else 1.0,
        options=options,
        loss_options=alg.loss_options,
        correction_options=alg.correction_options,
        transport_options=transport_options,
        seed=config.run.seed,
        scores=list(objective.scores),
        ref_model_path=objective.ref_model_path,
        teacher_model_path=objective.teacher_model_path,
        critic=objective.critic,
        placement=trainer_placement(config),
        config=config.model_dump(mode="json"),  # so that miles_configure fires in the ranks too
    )
    backend: Backend = make_component("backend", config.backend)
    if rl and shares_devices(config):
        missing = [m for m in ("offload", "onload") if not callable(getattr(backend, m, None))]
        if missing:
            raise ConfigError(
                f"placement.mode 'colocated' offloads the trainer while the engines generate, but backend "
                f"{config.backend!r} has no {' / '.join(missing)}(); use placement.mode: disaggregated"
            )
    adapter = _BackendStep(backend)
    try:
        backend.setup(spec)
        hooks_pm.register(adapter, name="backend")
        yield backend
    finally:
        if hooks_pm.is_registered(adapter):
            hooks_pm.unregister(adapter)
        backend.shutdown()


class _BackendStep:
    """Registers the run's backend as the implementation of ``miles_train_step``."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @hookimpl
    def miles_train_step(self, step: int, batch: TrainBatch) -> dict[str, float]:
        return self.backend.train_step(batch)


@contextlib.contextmanager
def served_teacher(config: MilesConfig, tokenizer: Any, loop: Any, log_dir: str) -> Iterator[Any]:
    """The served teachers of on-policy distillation as one rollout scorer (None without them).

    Teachers given by ``model`` get an embedded engine of their own; teachers given by
    ``url`` are attached to. Each must tokenize like the student; that is checked once here.
    """
    distill = config.distillation
    if distill is None or distill.teacher != "served":
        yield None
        return
    from miles.distill.served import ServedTeacher, check_same_tokenizer
    from miles.models.registry import resolve_model

    with contextlib.ExitStack() as stack:
        launch = {name: t.model for name, t in distill.teachers.items() if t.model is not None}
        urls = {name: t.url for name, t in distill.teachers.items() if t.url is not None}
        # Teachers are engines of the run's own kind: one given by its model is launched by it, and
        # every teacher is talked to through its client.
        launcher: EngineLauncher = make_component("engine", config.engine.launcher)
        stack.callback(launcher.shutdown)
        if launch:
            eng = config.engine
            options = {
                "device": eng.device,
                "dtype": eng.dtype or config.model.dtype,
                "max_batch_size": eng.max_batch_size,
                "startup_timeout_s": eng.startup_timeout_s,
                **eng.options,
            }
            names = sorted(launch)
            specs = [
                EngineSpec(model_path=resolve_model(launch[n]), host=eng.host, options=options) for n in names
            ]
            urls.update(zip(names, launcher.launch(specs, log_dir), strict=True))
        clients = {name: launcher.client(url) for name, url in urls.items()}

        async def close_clients() -> None:
            for client in clients.values():
                close = getattr(client, "aclose", None)  # not part of EngineClient
                if close is not None:
                    await close()

        stack.callback(lambda: loop.run_until_complete(close_clients()))
        for client in clients.values():
            loop.run_until_complete(check_same_tokenizer(client, tokenizer))
        yield ServedTeacher(
            clients,
            route_key=distill.route_key,
            temperature=config.rollout.temperature,
            top_k=distill.top_k,
            candidates=distill.top_k_candidates,
        )


def trainer_placement(config: MilesConfig) -> dict[str, Any]:
    """Where the backend's ranks run (plain data: it travels in the BackendSpec)."""
    p = config.placement
    placement: dict[str, Any] = {
        "launcher": p.launcher,
        "mode": resolved_placement(config) if config.mode == "rl" else p.mode or "disaggregated",
    }
    if p.launcher == "ray":
        placement |= {"ray_address": p.ray_address, "bundle": dict(p.trainer_bundle)}
    return placement


@contextlib.contextmanager
def placement_session(config: MilesConfig) -> Iterator[None]:
    """Connect to (or start) the Ray cluster for the run when placement.launcher is ray."""
    if config.placement.launcher != "ray":
        yield
        return
    from miles.placement import ray_session

    num_cpus = None
    if config.placement.ray_address is None:
        # A private cluster's CPUs are logical: make room for one bundle per rank and per engine
        # even on a 2-core machine (the processes share the cores, as they would locally).
        section = getattr(config, config.backend, None)
        ranks = getattr(section, "num_ranks", 1)
        num_cpus = max(os.cpu_count() or 1, ranks + config.engine.num_engines)
    with ray_session(config.placement.ray_address, num_cpus=num_cpus):
        yield


@contextlib.contextmanager
def offloaded_while(config: MilesConfig, backend: Any) -> Iterator[None]:
    """Colocated placement: the trainer's state leaves the shared devices while the engines generate
    (unless placement.offload_trainer is false)."""
    if not shares_devices(config) or not config.placement.offload_trainer:
        yield
        return
    from miles.tracking.timing import timed

    with timed("offload"):
        backend.offload()
    try:
        yield
    finally:
        with timed("onload"):
            backend.onload()


@contextlib.contextmanager
def engine_memory_held(config: MilesConfig, fleet: Any) -> Iterator[None]:
    """``engine.release_memory``: the engines hold their KV cache only while they generate."""
    if fleet is None or not config.engine.release_memory:
        yield
        return
    from miles.tracking.timing import timed

    with timed("engine_resume"):
        fleet.resume_memory()
    try:
        yield
    finally:
        with timed("engine_release"):
            fleet.release_memory()


def check_engine_versions(loop: Any, engines: list[Any], version: int) -> None:
    """After an update every engine must report the new version; anything else is a hard error."""

    async def versions() -> list[int]:
        import asyncio

        return list(await asyncio.gather(*(e.weight_version() for e in engines)))

    got = loop.run_until_complete(versions())
    wrong = [(e.url, v) for e, v in zip(engines, got, strict=True) if v != version]
    if wrong:
        raise EngineError(f"after the weight update to version {version}, engines report {wrong}")


def describe_update(stats: TransportStats) -> dict[str, float]:
    return {
        "time/weight_update_s": stats.seconds,  # the transport's own; the driver's clock replaces it
        "weight_sync/seconds": stats.seconds,
        "weight_sync/bytes": float(stats.bytes_sent),
        "weight_sync/buckets": float(stats.buckets),
        "engine/weight_version": float(stats.version),
        **{f"weight_sync/{key}": float(value) for key, value in stats.metrics.items()},
    }
