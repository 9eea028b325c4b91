"""The learning-curve PNG a run leaves (tracking.plot) and the pre-flight check that guards it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from miles.config.loader import load_recipe
from miles.errors import ConfigError
from miles.tracking.curves import CURVES_FILE, Curves, write_curves
from miles.tracking.summaries import check_plot_requirements, write_run_summaries

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(path: Path, steps: int = 6) -> Path:
    rows = []
    for step in range(steps):
        row: dict[str, object] = {
            "step": step,
            "rollout/reward_mean": 0.1 * step,
            "rollout/full_reward_frac": 0.05 * step,
            "train/loss": 1.0,
            "time/step_s": 0.5,
            "time/rollout_s": 0.3,
            "time/train_step_s": 0.2,
        }
        if step % 2 == 1:
            row["eval/arith/pass_rate"] = 0.2 * step
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_curves_read_the_reward_series_and_each_evaluation(tmp_path: Path) -> None:
    curves = Curves.from_jsonl(str(_metrics(tmp_path / "metrics.jsonl")))
    assert curves.names() == ["eval/arith/pass_rate", "rollout/full_reward_frac", "rollout/reward_mean"]
    steps, values = curves.series["eval/arith/pass_rate"]
    assert steps == [1, 3, 5] and values == pytest.approx([0.2, 0.6, 1.0])
    assert curves.series["rollout/reward_mean"][0] == list(range(6))


def test_write_curves_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib draws the curves")
    out = tmp_path / "curve.png"
    assert write_curves(str(_metrics(tmp_path / "metrics.jsonl")), str(out), title="t")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "curve.png.tmp").exists()


def test_nothing_to_draw_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "train/loss": 1.0}) + "\n")
    assert not write_curves(str(path), str(tmp_path / "c.png"), title="t")
    assert not (tmp_path / "c.png").exists()


def test_run_summaries_follow_tracking_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib draws the curves")
    _metrics(tmp_path / "metrics.jsonl")
    off = load_recipe("default", overrides=["tracking.plot=false"])
    write_run_summaries(off, str(tmp_path))
    assert (tmp_path / "time_breakdown.txt").is_file()
    assert not (tmp_path / CURVES_FILE).exists()
    write_run_summaries(load_recipe("default"), str(tmp_path))
    assert (tmp_path / CURVES_FILE).read_bytes()[:8] == PNG_MAGIC


def test_plot_true_without_matplotlib_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    check_plot_requirements(load_recipe("default"))  # null: draw when installed, so no error
    with pytest.raises(ConfigError, match=r"tracking\.plot is true, but matplotlib is not installed"):
        check_plot_requirements(load_recipe("default", overrides=["tracking.plot=true"]))
