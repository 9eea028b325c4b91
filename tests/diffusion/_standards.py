"""Committed standards for the diffusion recipes: record a run's registered metrics and compare a
later run against them, bit for bit where the machine and libraries are the standard's own.

A standard ``NAME.json`` sits in ``tests/diffusion/standards`` beside ``NAME.env.json``, the
environment it was made in. Deterministic mode repeats bit for bit on the same hardware and
software; on another CPU kernel set (AVX2 vs AVX512), processor or torch, rounding differs and
compounds over training steps, so there only the first iteration is compared, within a tolerance.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import pytest
import torch

from miles_diffusion.train import TIMING_PREFIX

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


def repeatable(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """The registered metrics less the wall-clock times."""
    return [{k: v for k, v in m.items() if not k.startswith(TIMING_PREFIX)} for m in history]


def write_standard(name: str, history: list[dict[str, float]]) -> Path:
    path = STANDARDS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(repeatable(history), indent=1) + "\n")
    path.with_suffix(".env.json").write_text(json.dumps(environment(), indent=1) + "\n")
    return path


def assert_matches_standard(name: str, history: list[dict[str, float]]) -> None:
    path = STANDARDS / f"{name}.json"
    standard = json.loads(path.read_text())
    got = repeatable(history)
    assert len(got) == len(standard)
    same_environment = json.loads(path.with_suffix(".env.json").read_text()) == environment()
    for iteration, (mine, theirs) in enumerate(zip(got, standard, strict=True)):
        assert mine.keys() == theirs.keys(), iteration
        if not same_environment and iteration > 0:
            continue
        for key, value in theirs.items():
            if same_environment:
                assert mine[key] == value, (iteration, key, mine[key].hex(), float(value).hex())
            else:  # the first iteration still agrees closely: the same computation, other rounding
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (iteration, key)
