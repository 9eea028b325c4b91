"""MLflow (``pip install 'miles-core[mlflow]'``, the skinny client is enough for a file or HTTP store).

``tracking_uri`` defaults to a file store in the run directory (``mlruns/``; MLflow 3 keeps
that store behind ``MLFLOW_ALLOW_FILE_STORE``, which this sets when unset); point it at a
tracking server (``http://host:5000``) to share runs. The run's id is kept in
``mlflow_run_id`` in the run directory, so a resumed Miles run continues the same MLflow run.
The recipe is stored as the run's ``config.json`` artifact (MLflow params are short strings).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field

from miles.capabilities import ComponentOptions
from miles.tracking.base import TrackerContext, finite_scalars, read_run_id, write_run_id

RUN_ID_FILE = "mlflow_run_id"
_STATUS = {"completed": "FINISHED", "interrupted": "KILLED"}  # anything else: FAILED


class MlflowOptions(ComponentOptions):
    tracking_uri: str | None = Field(None, description="MLflow tracking URI; None: file:<run dir>/mlruns")
    experiment: str = Field("miles", description="MLflow experiment name (created when missing)")


class MlflowTracker:
    Options = MlflowOptions
    requires: ClassVar[tuple[str, ...]] = ("mlflow",)
    install: ClassVar[str] = "miles-core[mlflow]"
    background: ClassVar[bool] = True  # called from its own thread (miles.tracking.registry)

    def __init__(self, ctx: TrackerContext, options: MlflowOptions) -> None:
        from mlflow.tracking import MlflowClient

        uri = options.tracking_uri or "file:" + os.path.abspath(os.path.join(ctx.run_dir, "mlruns"))
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked (it wants a database, which the skinny
            # client cannot open); a store inside the run directory is what this default is for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # The client, not mlflow's module-level "active run": two runs in one process stay apart.
        self.client: Any = MlflowClient(tracking_uri=uri)
        id_file = os.path.join(ctx.run_dir, RUN_ID_FILE)
        run_id = read_run_id(id_file)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(options.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(options.experiment)
            )
            run = self.client.create_run(experiment_id, run_name=ctx.run_name)
            run_id = run.info.run_id
            write_run_id(id_file, run_id)
            self.client.log_dict(run_id, dict(ctx.config), "config.json")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id: str = run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in finite_scalars(metrics).items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log(step, metrics)  # MLflow keeps each metric's points by step: late arrival is fine

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=_STATUS.get(status, "FAILED"))
