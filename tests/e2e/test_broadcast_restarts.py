"""Engine restarts under the default recipe's transport (broadcast): the weight group is re-formed.

The faults are injected as in ``test_engine_faults`` (its generate function signals an engine
mid-rollout); only the transport differs. The re-formed group is checked like the first: with
``weight_sync.check_equal`` the update after a re-formation randomises every engine and compares
every tensor with the trainer's (``weight_sync/checked_tensors``), so a restarted engine that
missed anything stops the run.
"""

from __future__ import annotations

import signal

import pytest

from e2e.test_engine_faults import Fault, Plan, _assert_complete, _config, _run

pytestmark = pytest.mark.slow

BROADCAST = ["transport=broadcast"]


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    config = _config(tmp_path_factory, "bcast2", "run.num_steps=3", *BROADCAST)
    return _run(config, Plan([Fault(signal.SIGKILL, step=1, engine=1, where="rollout")]))


def test_a_killed_engine_rejoins_the_broadcast_group_and_serves_the_trainers_weights(two_engines):
    out = two_engines
    assert out.error is None
    assert [r["step"] for r in out.rows] == [0, 1, 2]
    assert out.plan.faults[0].fired_at is not None
    step0, step1, step2 = out.rows
    assert step1["engine/faults"] == 1 and step1["engine/restarts"] == 1
    assert step1["engine/retried_requests"] >= 1
    assert out.rows[-1]["engine/quarantined"] == 0
    # The re-formed group carried the step's whole update to the restarted engine: no snapshot.
    assert "weight_sync/recovered" not in step1
    # Both engines compared tensor by tensor after the first update and after the re-formation only.
    assert step0["weight_sync/checked_tensors"] > 0
    assert step1["weight_sync/checked_tensors"] == step0["weight_sync/checked_tensors"]
    assert "weight_sync/checked_tensors" not in step2
    assert [r["engine/weight_version"] for r in out.rows] == [1, 2, 3]
    _assert_complete(out.rec, [0, 1, 2])


@pytest.fixture(scope="module")
def one_engine(tmp_path_factory):
    config = _config(tmp_path_factory, "bcast1", "run.num_steps=2", "engine.num_engines=1", *BROADCAST)
    return _run(config, Plan([Fault(signal.SIGKILL, step=0, engine=0, where="rollout")]))


@pytest.mark.extended
def test_the_only_engine_killed_requests_wait_for_its_restart(one_engine):
    out = one_engine
    assert out.error is None
    assert [r["step"] for r in out.rows] == [0, 1]
    step0, step1 = out.rows
    assert step0["engine/restarts"] == 1 and step0["engine/retried_requests"] >= 1
    assert "weight_sync/recovered" not in step0
    assert step0["weight_sync/checked_tensors"] > 0  # the restarted engine holds the trainer's weights
    assert [r["engine/weight_version"] for r in out.rows] == [1, 2]
    assert step1["engine/quarantined"] == 0
    _assert_complete(out.rec, [0, 1])
