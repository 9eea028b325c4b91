"""A killed run, resumed, continues the same W&B and MLflow runs (real libraries, offline / file store)."""

from __future__ import annotations

import glob
import os

import pytest

from miles import hookimpl
from miles.config import load_recipe
from miles.loop import train
from miles.plugins import get_plugin_manager

from .wandb_records import history, run_ids, wait_for_exit

pytestmark = pytest.mark.slow

RL_ONLY = ["eval=null", "warm_start=null", "rollout.reward=numeric_closeness", "train.lr=0.01"]


class _Kill:
    """Interrupts the run once step ``at`` is logged (its checkpoint is written by then)."""

    def __init__(self, at: int) -> None:
        self.at = at

    @hookimpl(trylast=True)
    def miles_on_metrics(self, step, metrics):
        if step == self.at:
            raise KeyboardInterrupt("simulated kill")


@pytest.mark.extended
def test_resumed_run_continues_the_same_wandb_and_mlflow_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    config = load_recipe(
        "default",
        [
            f"run.output_dir={tmp_path}",
            *RL_ONLY,
            "run.num_steps=2",
            "run.save_every=1",
            "run.export_hf=false",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.filters=[]",
            "tracking.console=false",
            "tracking.tensorboard=false",
            "tracking.backends=[wandb, mlflow]",
            "tracking.options.wandb.mode=offline",
        ],
    )
    pm = get_plugin_manager()
    kill = _Kill(at=0)
    pm.register(kill)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(config)
    finally:
        pm.unregister(kill)
    result = train(config, resume=True)
    assert result.steps_done == 2

    run_dir = result.run_dir
    with open(os.path.join(run_dir, "wandb_run_id"), encoding="utf-8") as f:
        wandb_id = f.read().strip()
    files = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb")))
    assert len(files) == 2  # one file per process attempt, one W&B run
    for path in files:
        wait_for_exit(path)
    assert [run_ids(p) for p in files] == [[wandb_id], [wandb_id]]
    steps = sorted(int(h["_step"]) for p in files for h in history(p) if "rollout/reward_mean" in h)
    assert steps == [0, 1]

    with open(os.path.join(run_dir, "mlflow_run_id"), encoding="utf-8") as f:
        mlflow_id = f.read().strip()
    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    assert len(client.search_runs([client.get_run(mlflow_id).info.experiment_id])) == 1
    assert sorted(m.step for m in client.get_metric_history(mlflow_id, "rollout/reward_mean")) == [0, 1]
    assert client.get_run(mlflow_id).info.status == "FINISHED"
