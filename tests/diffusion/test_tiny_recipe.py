"""The tiny Flow-GRPO recipe end to end: the reward rises, runs repeat bit for bit, and every
registered metric matches the committed standard exactly (the recipe's "fully gated" evidence).

Regenerate the standard (only after an intended numerical change, and say so in the commit):
``uv run python tests/diffusion/test_tiny_recipe.py``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles_diffusion.deterministic import check_attention_backends
from miles_diffusion.recipe import load_recipe
from miles_diffusion.train import TIMING_PREFIX, run

STANDARD = Path(__file__).parent / "standards" / "tiny_flow_grpo.json"
# Where the standard was produced. Deterministic mode repeats bit for bit on the same hardware and
# software; another CPU kernel set (AVX2 vs AVX512) or another torch rounds differently.
STANDARD_ENV = STANDARD.with_suffix(".env.json")


def _cpu_model() -> str:
    """The processor's name and a digest of its feature flags: virtual machines often report one generic
    name for different hosts, whose flags (and rounding) differ."""
    import hashlib

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
        import platform

        name = platform.processor() or platform.machine()
    return f"{name} [flags {hashlib.sha256(flags.encode()).hexdigest()[:12]}]"


def _environment() -> dict[str, str]:
    import diffusers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # Rounding can differ between processors of one instruction set (kernel choice, FMA use).
        "cpu_model": _cpu_model(),
    }


def _repeatable(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if not k.startswith(TIMING_PREFIX)} for m in history]


@pytest.fixture(scope="module")
def full_run() -> list[dict[str, float]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(load_recipe("tiny_flow_grpo"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_every_metric_matches_the_committed_standard_bit_for_bit(
    full_run: list[dict[str, float]],
) -> None:
    standard = json.loads(STANDARD.read_text())
    got = _repeatable(full_run)
    assert len(got) == len(standard)
    same_environment = json.loads(STANDARD_ENV.read_text()) == _environment()
    for iteration, (mine, theirs) in enumerate(zip(got, standard, strict=True)):
        assert mine.keys() == theirs.keys(), iteration
        if not same_environment and iteration > 0:
            continue  # rounding differences compound over training steps on other hardware
        for key, value in theirs.items():
            if same_environment:
                assert mine[key] == value, (iteration, key, mine[key].hex(), float(value).hex())
            else:  # the first iteration still agrees closely: the same computation, other rounding
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (iteration, key)


@pytest.mark.slow
def test_reward_rises(full_run: list[dict[str, float]]) -> None:
    before, after = full_run[0]["eval/reward_before"], full_run[-1]["eval/reward_after"]
    assert after > before + 0.1
    first = sum(m["reward/mean"] for m in full_run[:5]) / 5
    last = sum(m["reward/mean"] for m in full_run[-5:]) / 5
    assert last > first


@pytest.mark.slow
def test_two_deterministic_runs_are_equal_bit_for_bit(tmp_path: Path) -> None:
    recipe = replace(load_recipe("tiny_flow_grpo"), num_iterations=2)
    switch_before = torch.are_deterministic_algorithms_enabled()
    a = run(recipe, tmp_path / "a")
    b = run(recipe, tmp_path / "b")
    assert _repeatable(a) == _repeatable(b)
    assert torch.are_deterministic_algorithms_enabled() == switch_before  # restored after a run
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == a
    other = run(replace(recipe, seed=1))
    assert _repeatable(other) != _repeatable(a)


def test_deterministic_mode_refuses_unknown_attention_backends() -> None:
    class Processor:
        pass

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.processor = Processor()

    model = torch.nn.Sequential(Attention())
    with pytest.raises(ValueError, match="no deterministic mode"):
        check_attention_backends(model)


if __name__ == "__main__":
    torch.set_num_threads(1)
    history = _repeatable(run(load_recipe("tiny_flow_grpo")))
    STANDARD.parent.mkdir(parents=True, exist_ok=True)
    STANDARD.write_text(json.dumps(history, indent=1) + "\n")
    STANDARD_ENV.write_text(json.dumps(_environment(), indent=1) + "\n")
    print(f"wrote {STANDARD} ({len(history)} iterations)")
