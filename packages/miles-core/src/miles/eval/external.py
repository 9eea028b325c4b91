"""Mode ``external``: a backend plugin scores a checkpoint directory, knowing nothing else of the run.

``make_eval_backend`` resolves ``eval.backend`` like every Miles component (an entry
point in ``miles.eval_backends`` or ``pkg.module:attr``); a class is built with
``eval.backend_options`` as keyword arguments, and every ``EvalRequest`` carries the
same options for backends given as ready objects.

A backend may report the two version numbers itself (metrics ``mean_weight_version``
and ``mixed_version_fraction``); the evaluator then checks them like its own. The
built-in :class:`EmbeddedEngineEval` does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import tempfile
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.config.schema import DataSection
from miles.errors import ConfigError
from miles.eval.result import BACKEND_ERROR, EvalSkipped
from miles.eval.scoring import EvalScore, build_eval_set
from miles.eval.versions import VersionStats
from miles.interfaces import EngineClient, EvalBackend, EvalRequest

VERSION_METRICS = ("mean_weight_version", "mixed_version_fraction")


def make_eval_backend(ref: str, options: dict[str, Any]) -> EvalBackend:
    """The backend ``ref`` names: a class built with ``options``, or an object used as it is."""
    from miles.plugins import load_component, make_component

    obj = load_component("eval_backend", ref)
    return make_component("eval_backend", ref, options if isinstance(obj, type) else None)


def backend_metrics(value: Any, ref: str) -> tuple[dict[str, float], VersionStats | None]:
    """Validate what ``evaluate`` returned: metrics by name, and the version numbers if it reported both."""
    if not isinstance(value, Mapping):
        raise EvalSkipped(
            BACKEND_ERROR,
            f"eval backend {ref!r} returned a {type(value).__name__}, expected a dict of metrics",
        )
    metrics: dict[str, float] = {}
    for name, number in value.items():
        if not isinstance(name, str) or isinstance(number, str):
            raise EvalSkipped(
                BACKEND_ERROR, f"eval backend {ref!r} returned {name!r}: {number!r}, not a number"
            )
        try:
            metrics[name] = float(number)
        except (TypeError, ValueError):
            raise EvalSkipped(
                BACKEND_ERROR, f"eval backend {ref!r} returned {name!r}: {number!r}, not a number"
            ) from None
    reported = [metrics.pop(name) for name in VERSION_METRICS if name in metrics]
    if len(reported) != len(VERSION_METRICS):
        return metrics, None  # the backend cannot see versions (it only read the directory)
    mean, mixed = reported
    return metrics, VersionStats(
        mean_weight_version=mean if math.isfinite(mean) else None,
        mixed_version_fraction=mixed if math.isfinite(mixed) else None,
    )


class EmbeddedEvalOptions(ComponentOptions):
    """``eval.backend_options`` of the built-in ``embedded`` eval backend."""

    data: dict[str, Any] | str = Field(
        description="the eval prompts: a data section ({path: ..., ...}) or just the path"
    )
    reward: str = Field(description="reward name or import path")
    reward_options: dict[str, Any] | None = Field(None, description="the reward's options")
    max_prompts: int | None = Field(None, description="evaluate on the first N prompts only")
    n_samples_per_prompt: int = Field(1, description="samples per prompt (>= 1)")
    max_new_tokens: int = Field(64, description="tokens generated per sample (>= 1)")
    temperature: float = Field(1.0, description="sampling temperature (> 0)")
    generate_fn: str = Field("default", description="generate function name or import path")
    engine_options: dict[str, Any] | None = Field(
        None, description="options of its embedded engine (device, dtype, ...)"
    )
    tokenizer: str | None = Field(None, description="tokenizer directory (default: the checkpoint's own)")
    log_dir: str | None = Field(
        None, description="engine logs (default: a temporary directory, removed afterwards)"
    )


class EmbeddedEngineEval:
    """Built-in eval backend: an embedded engine of its own on the checkpoint directory, for one evaluation.

    It starts the engine on ``request.checkpoint_dir`` (tagged with the request's weight
    version, so every sampled token carries it), samples the eval prompts, scores them
    with the reward, reports the score and the version numbers, and stops the engine.
    The tokenizer is the checkpoint's own unless ``tokenizer`` names another directory.

    Options (``eval.backend_options``): ``data`` (a data section: ``{path: ..., ...}`` or
    just the path), ``reward`` and ``reward_options``, ``max_prompts``,
    ``n_samples_per_prompt``, ``max_new_tokens``, ``temperature``, ``generate_fn``,
    ``engine_options`` (embedded engine options: ``device``, ``dtype``,
    ``max_batch_size``, ``torch_threads``, ``startup_timeout_s``, ...), ``tokenizer``,
    ``log_dir`` (engine logs; default a temporary directory removed afterwards).
    """

    Options = EmbeddedEvalOptions

    def __init__(
        self,
        data: dict[str, Any] | str,
        reward: str,
        reward_options: dict[str, Any] | None = None,
        max_prompts: int | None = None,
        n_samples_per_prompt: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        generate_fn: str = "default",
        engine_options: dict[str, Any] | None = None,
        tokenizer: str | None = None,
        log_dir: str | None = None,
    ) -> None:
        section = DataSection.model_validate({"path": data} if isinstance(data, str) else data)
        engine_options = dict(engine_options or {})
        taken = sorted({"url", "weight_version"} & set(engine_options))
        if taken:
            raise ConfigError(
                f"eval backend 'embedded': engine_options may not set {taken}: it launches its own engine on the "
                "checkpoint and tags it with the request's weight version"
            )
        if n_samples_per_prompt < 1 or max_new_tokens < 1 or not temperature > 0:
            raise ConfigError(
                "eval backend 'embedded': n_samples_per_prompt and max_new_tokens must be >= 1 and temperature > 0"
            )
        # Resolved now (tokenizer later, from the checkpoint), so a bad data path or reward fails at start-up.
        self.eval_set = build_eval_set(
            data=section,
            tokenizer=None,
            reward=reward,
            reward_options=dict(reward_options or {}),
            max_prompts=max_prompts,
            n_samples_per_prompt=n_samples_per_prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generate_fn=generate_fn,
        )
        self.engine_options = {"device": "cpu", **engine_options}
        self.tokenizer = tokenizer
        self.log_dir = log_dir

    def evaluate(self, request: EvalRequest) -> dict[str, float]:
        from transformers import AutoTokenizer

        from miles.engines.launchers import EmbeddedLauncher
        from miles.interfaces import EngineSpec

        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer or request.checkpoint_dir)
        eval_set = dataclasses.replace(self.eval_set, tokenizer=tokenizer)
        spec = EngineSpec(
            model_path=request.checkpoint_dir,
            options={**self.engine_options, "weight_version": request.weight_version},
        )
        launcher = EmbeddedLauncher()
        with tempfile.TemporaryDirectory(prefix="miles-eval-engine-") as tmp:
            try:
                [url] = launcher.launch([spec], self.log_dir or tmp)
                score = asyncio.run(_score(eval_set, launcher.client(url), request.weight_version))
            finally:
                launcher.shutdown()
        if score.aborted:
            raise RuntimeError(f"the engine aborted {score.aborted} of {len(score.samples)} eval samples")
        return {
            **score.metrics,
            "mean_weight_version": _number(score.versions.mean_weight_version),
            "mixed_version_fraction": _number(score.versions.mixed_version_fraction),
        }


async def _score(eval_set: Any, client: EngineClient, version: int) -> EvalScore:
    try:
        return await eval_set.score([client], version)
    finally:
        close = getattr(client, "aclose", None)
        if close is not None:
            await close()
        await eval_set.aclose()


def _number(value: float | None) -> float:
    return math.nan if value is None else float(value)
