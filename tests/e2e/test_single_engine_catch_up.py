"""The only engine dies after the weights moved on: it is restarted and caught up before it rejoins.

A restarted engine holds the base weights (version 0). With several engines the others carry the
rollout until the next weight update brings it back; with one (the default recipe's
``engine.num_engines: 1``) nothing could finish the step's rollout, so the fleet brings it to
the version it served as soon as it is healthy again (a snapshot of the trainer's weights,
loaded into that engine alone). The faults are injected as in ``test_engine_faults``: its
generate function signals the engine mid-rollout, here at step 2, after two weight updates.
"""

from __future__ import annotations

import hashlib
import json
import signal

import pytest

from e2e.test_engine_faults import Fault, Outcome, Plan, _assert_complete, _config, _run
from miles.types import Status

pytestmark = pytest.mark.slow

ONE_ENGINE = ["engine.num_engines=1", "run.num_steps=4", "run.save_every=null"]


def _check_caught_up(out: Outcome, adapters: int = 1) -> None:
    assert out.error is None, out.error
    assert out.plan.faults[0].fired_at is not None
    assert [r["step"] for r in out.rows] == [0, 1, 2, 3]
    step1, step2, step3 = out.rows[1], out.rows[2], out.rows[3]
    assert step1["engine/restarts"] == 0
    assert step2["engine/faults"] == 1 and step2["engine/restarts"] == 1
    assert step2["engine/retried_requests"] >= 1
    # Caught up mid-rollout, so the step's own update was an ordinary one (no snapshot recovery).
    assert "weight_sync/recovered" not in step2
    assert step2["engine/catch_ups"] == 1
    assert step3["engine/quarantined"] == 0
    assert [r["engine/weight_version"] for r in out.rows] == [1, 2, 3, 4]
    if adapters == 1:
        _assert_complete(out.rec, [0, 1, 2, 3])
    else:  # each adapter draws its own prompts (from the same data, so the same indices)
        for step in (0, 1, 2, 3):
            samples = out.rec.samples[step]
            assert len(samples) == adapters * 4 * 4, step
            assert {s.status for s in samples} <= {Status.COMPLETED, Status.TRUNCATED}, step
            groups = {(s.metadata["lora_adapter"], s.prompt.index) for s in samples}
            assert len(groups) == adapters * 4, step
    # The samples of step 2 that finished after the restart come from the caught-up engine, at the
    # version it was brought to (2), not from its base weights (0).
    versions = {v for s in out.rec.samples[2] for v in s.weight_versions}
    assert versions == {2}, versions


@pytest.fixture(scope="module")
def broadcast_run(tmp_path_factory) -> Outcome:
    config = _config(tmp_path_factory, "one_bcast", *ONE_ENGINE, "transport=broadcast")
    return _run(config, Plan([Fault(signal.SIGKILL, step=2, engine=0, where="rollout")]))


def test_the_only_engine_killed_at_step_2_is_caught_up_and_the_run_finishes(broadcast_run):
    out = broadcast_run
    _check_caught_up(out)
    # The update after the restart re-formed the broadcast group with the caught-up engine in it and
    # compared every tensor with the trainer's (weight_sync.check_equal): it holds the trainer's weights.
    step0, step2, step3 = out.rows[0], out.rows[2], out.rows[3]
    assert step0["weight_sync/checked_tensors"] > 0
    assert step2["weight_sync/checked_tensors"] == step0["weight_sync/checked_tensors"]
    assert "weight_sync/checked_tensors" not in step3


@pytest.fixture(scope="module")
def disk_delta_run(tmp_path_factory) -> Outcome:
    config = _config(tmp_path_factory, "one_delta", *ONE_ENGINE, "transport=disk-delta")
    return _run(config, Plan([Fault(signal.SIGKILL, step=2, engine=0, where="rollout")]))


@pytest.mark.extended
def test_disk_delta_the_caught_up_engine_takes_the_next_delta(disk_delta_run):
    out = disk_delta_run
    _check_caught_up(out)
    # The snapshot it loaded is the base the next delta applies to: no recovery in any later update.
    assert all("weight_sync/recovered" not in r for r in out.rows)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Outcome:
    lora = ["lora.rank=8", 'lora.target_modules=["q_proj","v_proj","down_proj"]']
    config = _config(tmp_path_factory, "one_lora", *ONE_ENGINE, "transport=broadcast", *lora)
    return _run(config, Plan([Fault(signal.SIGKILL, step=2, engine=0, where="rollout")]))


def test_a_lora_runs_only_engine_killed_at_step_2_serves_the_adapter_again(lora_run):
    """A restarted engine holds the base and no adapter: the catch-up loads the adapter the trainer
    exported at the version the engine served, so the step's remaining samples (which ask for the
    adapter by name) are generated with it, and the next update's check compares every adapter tensor."""
    out = lora_run
    _check_caught_up(out)
    step0, step2 = out.rows[0], out.rows[2]
    assert step0["weight_sync/checked_tensors"] > 0
    assert step2["weight_sync/checked_tensors"] == step0["weight_sync/checked_tensors"]


def spread_score(sample) -> float:
    """A reward that spreads every group (a hash of the response in [0, 1)), so adapters always train."""
    digest = hashlib.sha256(sample.response_text.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32


@pytest.fixture(scope="module")
def multi_lora_run(tmp_path_factory) -> Outcome:
    adapters = {
        "math": {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
        "code": {"rank": 4, "target_modules": ["q_proj", "down_proj"], "lr": 0.02},
    }
    config = _config(
        tmp_path_factory,
        "one_multi_lora",
        *ONE_ENGINE,
        "transport=broadcast",
        f"lora={json.dumps({'adapters': adapters})}",
        "weight_sync.check_equal=false",  # refused with lora.adapters (the check scopes one adapter)
        "rollout.filters=[]",
        f"rollout.reward={__name__}:spread_score",
    )
    return _run(config, Plan([Fault(signal.SIGKILL, step=2, engine=0, where="rollout")]))


@pytest.mark.extended
def test_a_multi_lora_runs_only_engine_killed_at_step_2_serves_every_adapter_again(multi_lora_run):
    """The catch-up loads every adapter at the version the engine served: after the restart each
    adapter's samples carry the engine's log-probs of that adapter as trained (B moved from 0 at every
    step, so an engine serving the base or the other adapter would differ from the trainer)."""
    out = multi_lora_run
    _check_caught_up(out, adapters=2)
    for row in out.rows:
        for name in ("math", "code"):
            assert row[f"lora/{name}/train/grad_norm"] > 0, (row["step"], name)
            assert row[f"lora/{name}/correction/abs_dev"] < 1e-4, (row["step"], name)
