from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_diffusion.recipe import load_recipe, recipe_from_dict
from miles_diffusion.train import main


def test_driver_prints_the_evidence_level_and_writes_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["tiny_flow_grpo", "--out", str(tmp_path), "--iterations", "1"])
    out = capsys.readouterr().out
    assert "recipe tiny_flow_grpo: evidence level fully gated" in out
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert {"reward/mean", "train/loss", "eval/reward_before", "eval/reward_after"} <= set(metrics)


def test_recipes_refuse_unknown_keys_and_levels() -> None:
    base = {"name": "x", "evidence_level": "verified"}
    assert recipe_from_dict(base).name == "x"
    with pytest.raises(ValueError, match="unknown keys"):
        recipe_from_dict({**base, "sampler": {"num_step": 3}})
    with pytest.raises(ValueError, match="evidence_level"):
        recipe_from_dict({**base, "evidence_level": "probably fine"})
    assert load_recipe("tiny_flow_grpo").model.block_out_channels == (16, 32)


def test_driver_runs_a_supervised_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["tiny_sft", "--out", str(tmp_path), "--iterations", "1"])
    out = capsys.readouterr().out
    assert "recipe tiny_sft: evidence level proxy gated" in out
    assert "iter 0: loss " in out and "eval/loss before " in out and "eval/colour_error before " in out
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert {"train/loss", "eval/loss_before", "eval/loss_after"} <= set(json.loads(line))
