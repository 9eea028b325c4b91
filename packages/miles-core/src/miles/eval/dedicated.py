"""The dedicated eval fleet: engines of their own, loaded from a snapshot before every evaluation."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from miles.config.schema import MilesConfig
from miles.errors import EngineError
from miles.eval.result import ENGINE_ERROR, EvalSkipped
from miles.eval.versions import verify_engine_versions
from miles.interfaces import EngineClient, EngineLauncher, EngineSpec


def fleet_specs(config: MilesConfig, model_path: str) -> list[EngineSpec]:
    """``eval.num_engines`` engines like the rollout engines (``engine`` section), plus ``eval.engine_options``.

    They start from the run's initial model; each evaluation loads its snapshot over it.
    Ports are always picked free, so the fleet never collides with ``engine.port``.
    """
    eng, ev = config.engine, config.eval
    if ev is None:
        raise ValueError("the recipe has no eval section")
    explicit = {**eng.options, **ev.engine_options}
    options: dict[str, Any] = {
        "device": eng.device,
        "dtype": eng.dtype or config.model.dtype,
        "max_batch_size": eng.max_batch_size,
        "startup_timeout_s": eng.startup_timeout_s,
        # A running server's seed was fixed when it started: only a fleet this run starts gets it.
        **({} if "url" in explicit else {"seed": config.run.seed}),
        **explicit,
    }
    return [
        EngineSpec(model_path=model_path, host=eng.host, options=dict(options)) for _ in range(ev.num_engines)
    ]


def launch_fleet(config: MilesConfig, model_path: str, log_dir: str) -> tuple[EngineLauncher, list[str]]:
    """Start the fleet with the recipe's engine launcher; the launcher (to shut down) and the URLs."""
    from miles.plugins import make_component

    specs = fleet_specs(config, model_path)
    launcher: EngineLauncher = make_component("engine", config.engine.launcher)
    try:
        urls = launcher.launch(specs, log_dir)
        if len(urls) != len(specs):
            raise EngineError(
                f"launcher {config.engine.launcher!r} started {len(urls)} eval engines, expected {len(specs)}"
            )
    except BaseException:
        launcher.shutdown()
        raise
    return launcher, urls


async def load_snapshot(engines: Sequence[EngineClient], path: str, version: int) -> None:
    """Load ``path`` onto every engine as ``version``, then make each one confirm that version."""
    results = await asyncio.gather(
        *(e.update_weights_from_disk(path, weight_version=version) for e in engines),  # type: ignore[attr-defined]
        return_exceptions=True,
    )
    failed = [f"{e.url}: {r}" for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)]
    if failed:
        raise EvalSkipped(ENGINE_ERROR, f"loading snapshot {path} failed on {'; '.join(failed)}")
    await verify_engine_versions(engines, version, what="eval engine")
