"""Weights & Biases (``pip install 'miles-core[wandb]'``); ``mode: offline`` writes locally for a later sync.

The run's id is kept in ``wandb_run_id`` in the run directory: a resumed Miles run continues
the same W&B run instead of starting a second one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.tracking.base import TrackerContext, read_run_id, write_run_id

RUN_ID_FILE = "wandb_run_id"


class WandbOptions(ComponentOptions):
    project: str = Field("miles", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user); None: the account's default")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="None: wandb's own choice (WANDB_MODE, else online)"
    )
    group: str | None = Field(None, description="W&B run group")
    tags: list[str] = Field(default_factory=list, description="W&B run tags")


class WandbTracker:
    Options = WandbOptions
    requires: ClassVar[tuple[str, ...]] = ("wandb",)
    install: ClassVar[str] = "miles-core[wandb]"
    background: ClassVar[bool] = True  # called from its own thread (miles.tracking.registry)

    def __init__(self, ctx: TrackerContext, options: WandbOptions) -> None:
        import wandb

        id_file = os.path.join(ctx.run_dir, RUN_ID_FILE)
        run_id = read_run_id(id_file)  # None: W&B makes one
        self.run: Any = wandb.init(
            project=options.project,
            entity=options.entity,
            mode=options.mode,
            group=options.group,
            tags=options.tags or None,
            name=ctx.run_name,
            id=run_id,
            resume="allow",  # the same id continues the run; a new id starts one
            dir=ctx.run_dir,
            config=dict(ctx.config),
            # Its own process: W&B's service would otherwise outlive a failed Miles run's cleanup.
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        write_run_id(id_file, self.run.id)
        # Evaluations arrive after later steps were logged; W&B's step only moves forward, so
        # they are plotted against their own step counter.
        self.run.define_metric("eval/step")
        self.run.define_metric("eval/*", step_metric="eval/step")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({**metrics, "eval/step": step})

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)
