"""``miles replay train``: one training step on a dumped step's samples, without engines.

The run's recipe (``config.yaml`` beside the dump) builds the trainer and the objective as the
run did; the dumped samples are grouped by prompt, passed through the recipe's filters (a dump
holds the samples the filters dropped too), turned into a batch by the same
``make_train_batch`` and trained on once. With the weights the step was trained from (the
recipe's ``model.path`` for step 0) and the run's seed, the step's loss is the run's: that is
how to debug a loss or a backend on a fixed batch, or compare two backends on one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from miles.tracking.dumps import sample_from_record
from miles.types import Group, Sample


def groups_of(records: Sequence[dict[str, Any]]) -> list[Group]:
    """The dumped samples as the rollout's groups (one per prompt, in the order they were dumped)."""
    by_prompt: dict[int, list[Sample]] = {}
    for record in records:
        by_prompt.setdefault(record["prompt_index"], []).append(sample_from_record(record))
    return [Group(prompt=samples[0].prompt, samples=samples) for samples in by_prompt.values()]


def replay_train_step(
    run_dir: str,
    records: Sequence[dict[str, Any]],
    step: int,
    model: str | None = None,
    overrides: Sequence[str] = (),
) -> dict[str, float]:
    """Train once on ``records`` (one step's samples) with the run's recipe; the step's metrics."""
    from miles.config import load_recipe
    from miles.driver.hooks import Hooks
    from miles.driver.preflight import close_components, preflight
    from miles.driver.services import trainer
    from miles.driver.training import make_train_batch
    from miles.models.registry import resolve_model
    from miles.plugins import get_plugin_manager

    # No engines: no weight checks against them (the transport is set up with no engine to reach);
    # nothing tracked (the run's trackers may not be importable here, and this is no run).
    config = load_recipe(
        os.path.join(run_dir, "config.yaml"),
        [
            "weight_sync.check_equal=false",
            "tracking.backends=[]",
            "tracking.options={}",
            "rollout.dump=false",
            *overrides,
        ],
    )
    pm = get_plugin_manager()
    hooks = Hooks(pm)
    checked = preflight(config, hooks)
    try:
        groups = [g for g in groups_of(records) if all(keep(g) for _, keep in checked.components.filters)]
        if not groups:
            raise ValueError(f"the recipe's filters drop every group of step {step}: nothing to train on")
        model_path = checked.model_path if model is None else resolve_model(model)
        with trainer(config, model_path, checked.components.objective, [], {}, pm) as backend:
            batch, metrics = make_train_batch(groups, checked.components.objective, backend, step, hooks)
            metrics |= dict(hooks.miles_train_step(step=step, batch=batch) or {})
    finally:
        close_components(checked.components)
    return metrics
