"""The tiny Flow-GRPO recipe end to end: the reward rises, runs repeat bit for bit, and every
registered metric matches the committed standard exactly (the recipe's "fully gated" evidence).

Regenerate this machine's standard (only after an intended numerical change, or to gate a new
machine bit for bit; say so in the commit): ``uv run python -m tests.diffusion.test_tiny_recipe``
(tests/diffusion/_standards.py keeps one standard per environment).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles_diffusion.deterministic import check_attention_backends
from miles_diffusion.recipe import load_recipe
from miles_diffusion.train import run

from ._standards import assert_matches_standard, repeatable, run_recipe, write_standard

STANDARD = "tiny_flow_grpo"  # tests/diffusion/standards/tiny_flow_grpo*.json


@pytest.fixture(scope="module")
def full_run() -> list[dict[str, float]]:
    return run_recipe(STANDARD)


@pytest.mark.slow
def test_every_metric_matches_the_committed_standard_bit_for_bit(
    full_run: list[dict[str, float]],
) -> None:
    assert_matches_standard(STANDARD, full_run)


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
    assert repeatable(a) == repeatable(b)
    assert torch.are_deterministic_algorithms_enabled() == switch_before  # restored after a run
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == a
    other = run(replace(recipe, seed=1))
    assert repeatable(other) != repeatable(a)


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
    print(f"wrote {write_standard(STANDARD, run_recipe(STANDARD))}")
