"""Where a resumed run continues from, and what its recipe may have changed since."""

from __future__ import annotations

import logging
import os
from typing import Any

from miles.config.resume import check_resume_changes
from miles.config.schema import MilesConfig
from miles.config.yaml_io import parse_yaml
from miles.errors import RunComplete, RunDirError
from miles.interfaces import DataSource
from miles.run_dir import LoopState, RunDir

log = logging.getLogger(__name__)


def resume_point(
    run: RunDir, config: MilesConfig, data_source: DataSource
) -> tuple[str, LoopState, dict[str, tuple[Any, Any]]]:
    """The checkpoint to resume from, its loop state and the recipe changes; the data source is moved there.

    Refuses (before anything is written or started) a change the checkpoint cannot follow
    and a run that already trained all of ``run.num_steps``.
    """
    checkpoint = run.latest_checkpoint()
    if checkpoint is None:  # RunDir.check said so already; kept for callers that skip it
        raise RunDirError(f"--resume: no complete checkpoint under {run.checkpoints}")
    state = RunDir.read_state(checkpoint)
    changes = check_resume_changes(_earlier_config(run), config.model_dump(mode="json"), _plugin_mutable())
    if state.step >= config.run.num_steps:
        raise RunComplete(
            f"{run.path} already trained all {state.step} steps (checkpoint {os.path.basename(checkpoint)}); "
            f"nothing to resume. To train further, raise run.num_steps (e.g. --set run.num_steps={state.step + 10})"
        )
    data_source.load_state_dict(state.data_source)
    log.info(
        "resuming %s from checkpoint %s: step %d of %d, weight version %d",
        run.path,
        os.path.basename(checkpoint),
        state.step,
        config.run.num_steps,
        state.weight_version,
    )
    for key, (old, new) in changes.items():
        log.info("resume changes %s: %r -> %r", key, old, new)
    return checkpoint, state, changes


def _earlier_config(run: RunDir) -> dict[str, Any]:
    path = run.sub("config.yaml")
    if not os.path.isfile(path):
        raise RunDirError(
            f"--resume: {path} is missing, so the changes since the last start cannot be checked"
        )
    with open(path, encoding="utf-8") as f:
        data = parse_yaml(f.read(), path).data
    return data if isinstance(data, dict) else {}


def _plugin_mutable() -> list[str]:
    from miles.plugins import collect_config_sections, get_plugin_manager

    return [
        f"{name}.{key}"
        for name, section in collect_config_sections(get_plugin_manager()).items()
        for key in section.resume_mutable
    ]
