"""Before a run starts anything: check, decide where it starts from, and write its run directory.

Everything that can refuse a run refuses it here, before a file is written or a process
started: the run directory's rules, the pre-flight checks (plugins, model, data,
components, what they need of each other, ports), and a resume's changed settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.config.schema import MilesConfig
from miles.driver.components import Components
from miles.driver.preflight import preflight
from miles.driver.resume import resume_point
from miles.run_dir import TRAINED_PROMPTS, LoopState, RunDir
from miles.tracking.jsonl import truncate_after

if TYPE_CHECKING:
    from miles.driver.hooks import Hooks


@dataclass
class RunStart:
    """Where a run starts: its directory, its checked components, and the checkpoint it resumes (if any)."""

    run: RunDir
    model_path: str
    components: Components
    state: LoopState  # the loop state to start from (a fresh one, or the checkpoint's)
    checkpoint: str | None  # the checkpoint resumed from


def start_run(config: MilesConfig, *, resume: bool, overwrite: bool, hooks: Hooks) -> RunStart:
    from miles.config import dump_config

    run = RunDir(config.run_dir, config.run.output_dir)
    run.check(resume=resume, overwrite=overwrite)
    checked = preflight(config, hooks)
    # A run stopped in its warm start resumes that stage; RL itself then starts afresh.
    from_checkpoint = resume and not run.in_warm_start()
    checkpoint, state, changes = (
        resume_point(run, config, checked.components.data_source)
        if from_checkpoint
        else (None, LoopState(), {})
    )
    run.prepare(resume=resume, overwrite=overwrite)
    if checkpoint:
        run.keep_config_history()
        run.record_resume(checkpoint, {k: list(v) for k, v in changes.items()})
        for path in (run.sub("metrics.jsonl"), run.sub(TRAINED_PROMPTS)):
            truncate_after(path, state.step - 1)  # the resumed run redoes the steps after the checkpoint
    with open(run.sub("config.yaml"), "w", encoding="utf-8") as f:
        f.write(dump_config(config))
    return RunStart(run, checked.model_path, checked.components, state, checkpoint)
