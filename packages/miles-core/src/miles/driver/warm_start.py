"""The warm start: a supervised stage that runs to completion before RL, inside the same run.

RL from random weights rarely learns to read its prompt before it settles on one answer (a
group of identical answers carries no signal; docs/benchmarks.md §15). A short supervised
stage first (a "cold start") gives RL a policy whose samples differ in quality, which is what
a group-relative advantage needs. The stage is an ordinary SFT recipe, run by the same driver
into ``RUN/warm_start/`` (metrics, checkpoints and ``final/`` of its own), from the RL
recipe's ``model.path``; RL then starts from its ``final/``.

Resuming: a run stopped during its warm start resumes that stage (from its last checkpoint,
or afresh if it saved none), then starts RL; a run stopped during RL skips the completed stage.
"""

from __future__ import annotations

import logging
import os

from miles.config.schema import MilesConfig
from miles.errors import ConfigError, MilesError
from miles.run_dir import WARM_START_DIR, RunDir

log = logging.getLogger(__name__)


def warm_start_config(config: MilesConfig, run_dir: str) -> MilesConfig:
    """The stage's config: its recipe and overrides, from ``config``'s model, writing into ``run_dir``.

    Raises ``ConfigError`` (prefixed ``warm_start:``) for a recipe that does not load or is not
    a supervised one, before anything is written.
    """
    from miles.config import load_recipe

    ws = config.warm_start
    if ws is None:
        raise ValueError("warm_start_config: the recipe has no warm_start section")
    try:
        stage = load_recipe(ws.recipe, ws.overrides)
    except ConfigError as e:
        raise ConfigError(f"warm_start (recipe {ws.recipe!r}): {e}") from e
    if stage.mode != "sft":
        raise ConfigError(
            f"warm_start.recipe {ws.recipe!r} has mode {stage.mode!r}; a warm start is a supervised stage "
            "(a recipe with mode: sft, e.g. the built-in sft-arith)"
        )
    if not stage.run.export_hf:
        raise ConfigError(
            f"warm_start.recipe {ws.recipe!r} sets run.export_hf: false; RL starts from the stage's exported "
            "final/ policy, so the stage must export it"
        )
    # Where it runs and what it starts from are the RL run's; so is whether a console is drawn.
    run = stage.run.model_copy(update={"output_dir": run_dir, "name": WARM_START_DIR})
    model = stage.model.model_copy(update={"path": config.model.path})
    tracking = stage.tracking.model_copy(update={"console": config.tracking.console})
    return stage.model_copy(update={"run": run, "model": model, "tracking": tracking})


def run_warm_start(config: MilesConfig, run: RunDir, *, resume: bool) -> str:
    """Run, finish or skip the warm start of the run in ``run``; returns its final policy's directory."""
    from miles.loop import train

    stage_config = warm_start_config(config, run.path)
    stage = RunDir(stage_config.run_dir, run.path)
    marker = stage.read_marker()
    final = stage.sub("final")
    if marker is not None and marker.status == "completed" and os.path.isdir(final):
        log.info("warm start completed earlier: RL starts from %s", final)
        return final
    # A stage that saved a checkpoint continues from it; one that did not starts again (its
    # directory is this run's own, so replacing it deletes nothing a user wrote).
    stage_resume = resume and stage.latest_checkpoint() is not None
    log.info("warm start: %s for %d steps in %s", stage_config.recipe, stage_config.run.num_steps, stage.path)
    result = train(stage_config, resume=stage_resume, overwrite=not stage_resume)
    if result.final_dir is None:
        raise MilesError(f"the warm start in {stage.path} stopped before its last step; RL did not start")
    return result.final_dir
