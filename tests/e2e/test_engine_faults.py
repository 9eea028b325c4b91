"""Engine fault tolerance end to end: real engine processes killed (SIGKILL) or stopped (SIGSTOP)
mid-rollout and mid-weight-update, sync and fully async; the run goes on, or fails in one line.

Starting two engines and a trainer costs most of a run on a 2-core machine, so each run carries
several faults (one per step) and the tests below check each fault's step in a shared run. The
faults are injected at fixed points, so the runs are deterministic:

- mid-rollout: a generate function (this module's ``faulty_generate``, named by import path in
  the recipe) signals engine 1 of the fleet, then sends its request there, while the other
  requests of the rollout are in flight on both engines;
- mid-update: a plugin signals engine 1 when the step's checkpoint is saved, which is right before
  the loop pushes the new weights to the engines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass, field

import pytest

from miles import hookimpl
from miles.builtins.rollout.generate import single_turn_generate
from miles.config import load_recipe
from miles.engines.client import call_engine
from miles.errors import EngineError
from miles.interfaces import RolloutContext
from miles.loop import train
from miles.plugins import get_plugin_manager
from miles.types import Sample, Status

pytestmark = pytest.mark.slow

FAST = [
    "engine.num_engines=2",
    "transport=disk-delta",
    "rollout.filters=[]",  # keep every group, so each step's batch is exactly prompts_per_step
    "rollout.max_new_tokens=8",
    "engine.health_check_interval_s=0.2",  # a fault is found within 0.2 s (a hang within 1.5 s)
    "engine.health_timeout_s=1.5",
]


@dataclass
class Fault:
    """Signal ``sig`` to engine ``engine`` at step ``step``, mid-``where`` (rollout or update)."""

    sig: int
    step: int
    engine: int
    where: str
    fired_at: float | None = None  # monotonic time of the injection
    pid: int | None = None

    def due(self, step: int, where: str) -> bool:
        # At or after its step: a fully asynchronous worker may start no new group during a given step.
        return self.fired_at is None and step >= self.step and where == self.where

    def inject(self, url: str) -> None:
        self.pid = call_engine(url, "/get_server_info", method="GET", timeout=10)["pid"]
        os.kill(self.pid, self.sig)
        self.fired_at = time.monotonic()


@dataclass
class Plan:
    faults: list[Fault]
    urls: list[str] = field(default_factory=list)  # the fleet's engines, as the generate function sees them

    def fire(self, step: int, where: str) -> None:
        for fault in self.faults:
            if fault.due(step, where):
                fault.inject(self.urls[fault.engine])


PLAN: Plan | None = None


async def faulty_generate(ctx: RolloutContext, sample: Sample) -> Sample:
    """The built-in single-turn generate function, with the planned mid-rollout faults injected first
    (while the rollout's other requests are in flight on both engines)."""
    plan = PLAN
    if plan is not None:
        if not plan.urls:
            plan.urls = [e.url for e in ctx.engines]
        if sample.group_index == 0:
            plan.fire(ctx.step, "rollout")
    return await single_turn_generate(ctx, sample)


class _Recorder:
    """What each step trained on; injects the planned mid-update faults (the checkpoint of a step is
    saved right before its weight update)."""

    def __init__(self) -> None:
        self.samples: dict[int, list[Sample]] = {}

    @hookimpl
    def miles_advantages_postprocess(self, batch):
        self.samples[batch.step] = list(batch.samples)

    @hookimpl
    def miles_on_checkpoint_saved(self, step, directory):
        if PLAN is not None:
            PLAN.fire(step, "update")


@dataclass
class Outcome:
    plan: Plan
    rec: _Recorder
    rows: list[dict]
    error: EngineError | None
    seconds: float


def _run(config, plan: Plan) -> Outcome:
    global PLAN
    rec = _Recorder()
    pm = get_plugin_manager()
    pm.register(rec)
    PLAN = plan
    error = None
    t0 = time.monotonic()
    try:
        train(config)
    except EngineError as exc:
        error = exc
    finally:
        PLAN = None
        pm.unregister(rec)
    rows = _rows(os.path.join(config.run_dir, "metrics.jsonl"))
    return Outcome(plan, rec, rows, error, time.monotonic() - t0)


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _config(tmp_path_factory, name: str, *overrides: str):
    base = [
        f"run.output_dir={tmp_path_factory.mktemp(name)}",
        "warm_start=null",
        "eval=null",
        # The RL settings these tests were written for (the default recipe's before its warm start).
        "rollout.reward=numeric_closeness",
        "train.lr=0.01",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "tracking.console=false",
        "weight_sync.check_equal=true",
        "run.save_every=1",  # the mid-update faults are injected when a step's checkpoint is saved
        f"rollout.generate_fn={__name__}:faulty_generate",
        *FAST,
        *overrides,
    ]
    return load_recipe("default", base)


# Sync: a kill mid-rollout (step 1), a SIGSTOP mid-rollout (step 2), a kill mid-update (step 3).
SYNC_FAULTS = [
    Fault(signal.SIGKILL, step=1, engine=1, where="rollout"),
    Fault(signal.SIGSTOP, step=2, engine=1, where="rollout"),
    Fault(signal.SIGKILL, step=3, engine=0, where="update"),
]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> Outcome:
    config = _config(tmp_path_factory, "sync", "run.num_steps=5")
    return _run(config, Plan([dataclasses.replace(f) for f in SYNC_FAULTS]))


# Fully async: a kill mid-rollout (step 1), a SIGSTOP mid-update (step 2), then a kill at step 3
# that the restart budget (2) no longer covers.
ASYNC_FAULTS = [
    Fault(signal.SIGKILL, step=1, engine=1, where="rollout"),
    Fault(signal.SIGSTOP, step=2, engine=0, where="update"),
    Fault(signal.SIGKILL, step=4, engine=1, where="update"),
]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Outcome:
    config = _config(
        tmp_path_factory, "async", "run.num_steps=6", "schedule=fully_async", "engine.max_restarts=2"
    )
    return _run(config, Plan([dataclasses.replace(f) for f in ASYNC_FAULTS]))


def _assert_complete(rec: _Recorder, steps: list[int], groups: int = 4, n: int = 4) -> None:
    """Every step trained on whole groups of real samples (none lost, none failed or aborted)."""
    for step in steps:
        samples = rec.samples[step]
        assert len(samples) == groups * n, step
        assert {s.status for s in samples} <= {Status.COMPLETED, Status.TRUNCATED}, step
        assert len({s.prompt.index for s in samples}) == groups, step


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie keeps its pid until its parent reaps it; it runs no more.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_sync_run_survives_every_fault_and_trains_on_complete_groups(sync_run):
    assert sync_run.error is None
    assert [r["step"] for r in sync_run.rows] == [0, 1, 2, 3, 4]
    assert all(f.fired_at is not None for f in sync_run.plan.faults)
    assert sync_run.rows[-1]["engine/restarts"] == 3
    assert sync_run.rows[-1]["engine/quarantined"] == 0  # every engine restarted, caught up, serving
    assert [r["engine/weight_version"] for r in sync_run.rows] == [1, 2, 3, 4, 5]
    _assert_complete(sync_run.rec, [0, 1, 2, 3, 4])
    assert all(_pid_gone(f.pid) for f in sync_run.plan.faults)  # the stopped one was killed, not left


def test_kill_mid_rollout_retries_the_requests_on_the_other_engine(sync_run):
    step1 = sync_run.rows[1]
    assert step1["engine/faults"] == 1 and step1["engine/restarts"] == 1
    assert step1["engine/retried_requests"] >= 1
    # The restarted engine (base weights) caught up from a snapshot during the step's update.
    assert step1["weight_sync/recovered"] == 1.0


def test_sigstop_mid_rollout_is_found_hung_within_the_health_timeout(sync_run):
    before, step2 = sync_run.rows[1], sync_run.rows[2]
    assert step2["engine/restarts"] == 2
    assert step2["engine/retried_requests"] > before["engine/retried_requests"]
    # Its requests were held until the health check (1.5 s timeout) found it hung, then cut and retried.
    assert 1.0 <= step2["time/rollout_s"] < 15.0


def test_kill_mid_weight_update_is_recovered_and_the_next_update_is_ordinary(sync_run):
    step3, step4 = sync_run.rows[3], sync_run.rows[4]
    assert step3["weight_sync/recovered"] == 1.0 and step3["engine/restarts"] == 3
    assert step3["engine/weight_version"] == 4
    assert "weight_sync/recovered" not in step4  # the restarted engine took the next disk-delta update


def test_fully_async_survives_a_kill_mid_rollout_and_a_sigstop_mid_update(async_run):
    rows = {r["step"]: r for r in async_run.rows}
    kill, stop = async_run.plan.faults[:2]
    assert kill.fired_at is not None and stop.fired_at is not None
    assert rows[2]["weight_sync/recovered"] == 1.0  # the update that met the stopped engine
    assert rows[3]["engine/restarts"] == 2 and rows[3]["engine/retried_requests"] >= 1
    assert rows[3]["engine/quarantined"] == 0
    assert [rows[s]["engine/weight_version"] for s in range(4)] == [1, 2, 3, 4]
    _assert_complete(async_run.rec, [0, 1, 2, 3])


def test_restart_budget_spent_fails_in_one_line_naming_the_engine_and_its_log(async_run):
    assert async_run.error is not None
    message = str(async_run.error)
    assert "\n" not in message
    url = async_run.plan.urls[1]
    assert f"engine 1 at {url}" in message
    assert "killed by SIGKILL" in message
    assert "restart budget spent (engine.max_restarts 2)" in message
    assert os.path.join("engines", "engine-1.log") in message
    assert 4 not in {r["step"] for r in async_run.rows}  # the step whose update lost its engine
    assert _pid_gone(async_run.plan.faults[-1].pid)
