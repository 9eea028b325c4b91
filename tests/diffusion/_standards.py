"""Committed standards for the diffusion recipes: record a run's registered metrics and compare a
later run against them, bit for bit where the machine and libraries are the standard's own.

A standard ``NAME.json`` sits in ``tests/diffusion/standards`` beside ``NAME.env.json``, the
environment it was made in; a standard of the same recipe made in another environment is
``NAME@<digest>.json`` (``digest`` names its environment). Deterministic mode repeats bit for bit
on the same hardware and software, so a run is compared bit for bit with the standard of its own
environment. On a machine no standard was made on (another CPU kernel set, AVX2 vs AVX512, another
processor or torch) rounding differs and compounds over training steps, so there only the first
iteration is compared with the first standard, within a tolerance; write that machine's standard
(``write_standard``) to gate it bit for bit too.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import pytest
import torch

from miles_diffusion.train import TIMING_PREFIX


def run_recipe(name: str, iterations: int | None = None) -> list[dict[str, float]]:
    """Run a built-in recipe (cut to ``iterations``) on one thread, as its standard was made."""
    from dataclasses import replace

    from miles_diffusion.recipe import load_recipe
    from miles_diffusion.train import run

    recipe = load_recipe(name)
    if iterations is not None:
        recipe = replace(recipe, num_iterations=iterations)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(recipe)
    finally:
        torch.set_num_threads(threads)


STANDARDS = Path(__file__).parent / "standards"


def cpu_model() -> str:
    """The processor's name and a digest of its feature flags: virtual machines often report one
    generic name for different hosts, whose flags (and rounding) differ."""
    name, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        name = platform.processor() or platform.machine()
    return f"{name} [flags {hashlib.sha256(flags.encode()).hexdigest()[:12]}]"


def environment() -> dict[str, str]:
    import diffusers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # Rounding can differ between processors of one instruction set (kernel choice, FMA use).
        "cpu_model": cpu_model(),
    }


NOT_REPEATABLE = frozenset(
    {
        # A run through the core loop (``miles run``) also logs these, which measure the machine,
        # not the computation: the weight hand-off's wall-clock duration, a rate over the rollout's
        # wall-clock time (0.0 without tokens, but a clock divides it), and the CPU seconds the
        # engine fleet's health checks used.
        "weight_sync/seconds",
        "rollout/tokens_per_s",
        "engine/health_check_cpu_s",
    }
)
"""Registered metrics a standard leaves out beside the wall-clock times under ``time/``."""


def repeatable(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """The registered metrics less the wall-clock times (``time/...``) and :data:`NOT_REPEATABLE`."""
    return [
        {k: v for k, v in m.items() if not k.startswith(TIMING_PREFIX) and k not in NOT_REPEATABLE}
        for m in history
    ]


def _digest(env: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:10]


def _standards(name: str) -> list[Path]:
    """The committed standards of ``name``: the first one, then those of other environments."""
    first = STANDARDS / f"{name}.json"
    others = sorted(STANDARDS.glob(f"{name}@*.json"))
    return [p for p in [first, *others] if p.is_file() and not p.name.endswith(".env.json")]


def _env_of(path: Path) -> dict[str, str]:
    return json.loads(path.with_suffix(".env.json").read_text())


def write_standard(name: str, history: list[dict[str, float]]) -> Path:
    """Record ``history`` as the standard of this environment (replacing only that one)."""
    env = environment()
    existing = [p for p in _standards(name) if _env_of(p) == env]
    if existing:
        path = existing[0]
    elif (STANDARDS / f"{name}.json").is_file():
        path = STANDARDS / f"{name}@{_digest(env)}.json"
    else:
        path = STANDARDS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(repeatable(history), indent=1) + "\n")
    path.with_suffix(".env.json").write_text(json.dumps(env, indent=1) + "\n")
    return path


def assert_matches_standard(name: str, history: list[dict[str, float]]) -> None:
    standards = _standards(name)
    assert standards, f"no committed standard for {name} in {STANDARDS}"
    env = environment()
    own = [p for p in standards if _env_of(p) == env]
    path = own[0] if own else standards[0]
    standard = json.loads(path.read_text())
    got = repeatable(history)
    assert len(got) == len(standard)
    same_environment = bool(own)
    for iteration, (mine, theirs) in enumerate(zip(got, standard, strict=True)):
        assert mine.keys() == theirs.keys(), iteration
        if not same_environment and iteration > 0:
            continue
        for key, value in theirs.items():
            if same_environment:
                assert mine[key] == value, (
                    path.name,
                    iteration,
                    key,
                    float(mine[key]).hex(),
                    float(value).hex(),
                )
            else:  # the first iteration still agrees closely: the same computation, other rounding
                # (abs: a loss near zero, -2.4e-4 on one host, moved by 4e-6 on another)
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (path.name, iteration, key)
