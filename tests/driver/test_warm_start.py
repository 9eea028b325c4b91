"""The warm start: an SFT stage run before RL inside the same run directory (miles.driver.warm_start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles import hookimpl
from miles.config import load_recipe
from miles.driver.warm_start import warm_start_config
from miles.errors import ConfigError
from miles.run_dir import MARKER, WARM_START_DIR, RunDir


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_stage_runs_the_named_sft_recipe_from_the_rl_model_inside_the_run(tmp_path):
    config = load_recipe(
        "default",
        [f"run.output_dir={tmp_path}", "tracking.console=false", "model.path=builtin:tiny-qwen3"],
    )
    stage = warm_start_config(config, config.run_dir)
    assert stage.mode == "sft"
    assert stage.run_dir == str(tmp_path / "default" / WARM_START_DIR)
    assert stage.model.path == "builtin:tiny-qwen3"
    assert stage.run.num_steps == 150  # the default recipe's override of sft-arith's 40
    assert stage.tracking.console is False  # the RL run's console setting reaches the stage


@pytest.mark.parametrize(
    ("warm_start", "message"),
    [
        ("{recipe: default}", "has mode 'rl'; a warm start is a supervised stage"),
        ("{recipe: no-such-recipe}", "warm_start (recipe 'no-such-recipe')"),
        ("{recipe: sft-arith, overrides: [run.export_hf=false]}", "must export it"),
        ("{recipe: sft-arith, overrides: [train.lrr=1]}", "lrr"),
    ],
)
def test_a_bad_stage_is_refused_before_anything_is_written(tmp_path, warm_start, message):
    from miles.driver.preflight import preflight

    config = load_recipe("default", [f"run.output_dir={tmp_path}", f"warm_start={warm_start}"])
    with pytest.raises(ConfigError) as e:
        preflight(config)
    assert message in str(e.value)
    assert not (tmp_path / "default").exists()


def test_an_sft_recipe_cannot_have_a_warm_start():
    with pytest.raises(ConfigError, match="warm_start runs an SFT stage before RL"):
        load_recipe("sft-arith", ["warm_start={recipe: sft-arith}"])


def test_a_run_stopped_in_its_warm_start_is_resumable_and_not_replaced_silently(tmp_path):
    run = RunDir(str(tmp_path / "r"), str(tmp_path))
    run.prepare(resume=False, overwrite=False)
    stage = RunDir(run.sub(WARM_START_DIR), run.path)
    stage.prepare(resume=False, overwrite=False)
    assert run.in_warm_start()
    run.check(resume=True, overwrite=False)  # resumable: the stage goes on from where it stopped
    # Without --resume or --overwrite the stage's progress is not deleted as a failed start-up would be.
    with pytest.raises(Exception, match="pass --resume to continue it"):
        run.check(resume=False, overwrite=False)
    assert (Path(stage.path) / MARKER).is_file()


class _StopWarmStartOnce:
    """Interrupts the warm start (an SFT step reports ``loss/nll``) at its third step, once."""

    def __init__(self) -> None:
        self.fired = False

    @hookimpl
    def miles_on_metrics(self, step, metrics):
        if not self.fired and step == 2 and "loss/nll" in metrics:
            self.fired = True
            raise KeyboardInterrupt


@pytest.mark.extended
@pytest.mark.slow
def test_an_interrupted_warm_start_resumes_from_its_checkpoint_then_rl_starts_from_its_policy(tmp_path):
    from miles.loop import train
    from miles.plugins import get_plugin_manager

    overrides = [
        f"run.output_dir={tmp_path}",
        "run.num_steps=2",
        "run.save_every=null",
        "eval=null",
        "tracking.console=false",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "warm_start={recipe: sft-arith, overrides: [run.num_steps=4, run.save_every=2, sft.batch_size=8]}",
    ]
    config = load_recipe("default", overrides)
    stopper = _StopWarmStartOnce()
    pm = get_plugin_manager()
    pm.register(stopper)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(config)
    finally:
        pm.unregister(stopper)
    run_dir = tmp_path / "default"
    stage_dir = run_dir / WARM_START_DIR
    assert [r["step"] for r in _rows(stage_dir / "metrics.jsonl")] == [0, 1, 2]
    assert not (run_dir / "metrics.jsonl").exists()  # RL never started

    result = train(config, resume=True)
    # The stage redid its step 2 from the step-2 checkpoint, finished, and RL trained from its policy.
    assert [r["step"] for r in _rows(stage_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert json.loads((stage_dir / MARKER).read_text())["status"] == "completed"
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == [0, 1]
    assert result.final_dir is not None
    # A resumed run that trained all its steps says so; the completed stage is not run again.
    stage_steps = len(_rows(stage_dir / "metrics.jsonl"))
    with pytest.raises(Exception, match=r"no complete checkpoint|already trained"):
        train(config, resume=True)
    assert len(_rows(stage_dir / "metrics.jsonl")) == stage_steps
