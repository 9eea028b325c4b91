"""Broadcast after an engine restart: the weight group is re-formed and reaches the new process.

Real embedded engines (their own launcher, so one can be killed and restarted): the trainer side
of the old group is released without waiting for the dead member, the live engine destroys its
end and joins a second group, the restarted one joins it too, and the next update reaches both,
checked tensor by tensor (the re-armed weight-equality check) and by what they generate.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from miles.engines.client import SyncEngineClient
from miles_transports.broadcast import BroadcastTransport
from transports.test_transports import SMALL_BUCKET_MB, assert_engines_serve, new_weights, reference_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(engine_model: str, tmp_path_factory: pytest.TempPathFactory):
    """Two embedded engines and the launcher that started them (to restart one)."""
    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec

    launcher = EmbeddedLauncher(startup_timeout_s=120)
    options = {"torch_threads": 1, "max_batch_size": 4}
    try:
        urls = launcher.launch(
            [EngineSpec(model_path=engine_model, options=dict(options)) for _ in range(2)],
            str(tmp_path_factory.mktemp("engine-logs")),
        )
        yield launcher, urls
    finally:
        launcher.shutdown()


def _info(url: str) -> dict:
    with SyncEngineClient(url, timeout=60) as client:
        return client.get_server_info()


def test_reconnect_after_a_restart_reaches_the_new_engine_process(fleet, engine_model):
    launcher, urls = fleet
    transport = BroadcastTransport(bucket_mb=SMALL_BUCKET_MB, timeout_s=60, flatten=True, check_equal=True)
    transport.connect(urls, rank=0, world_size=1, device="cpu")
    try:
        first = transport.group_name
        weights = new_weights(engine_model, seed=5)
        stats = transport.send(iter(weights.items()), version=1)
        assert stats.metrics["checked_tensors"] > 0
        assert_engines_serve(urls, reference_model(engine_model, weights), version=1)

        old_pid = _info(urls[1])["pid"]
        os.kill(old_pid, signal.SIGKILL)
        launcher.restart(urls[1], 120)
        assert _info(urls[1])["pid"] != old_pid and _info(urls[1])["groups"] == []

        t0 = time.monotonic()
        transport.reconnect(urls)
        assert time.monotonic() - t0 < 30  # the dead member's end did not hold up the teardown
        assert transport.group_name != first
        # The live engine destroyed its old group and joined the second one; the new process joined it.
        assert _info(urls[0])["groups"] == [transport.group_name]
        assert _info(urls[1])["groups"] == [transport.group_name]

        weights2 = new_weights(engine_model, seed=6)
        stats = transport.send(iter(weights2.items()), version=2)
        # Compared again after the re-formation (both engines randomised first, then checked).
        assert stats.metrics["checked_tensors"] == 2 * len(weights2)
        assert_engines_serve(urls, reference_model(engine_model, weights2), version=2)
        # And only then: the update after that one is not compared again.
        stats = transport.send(iter(weights2.items()), version=3)
        assert "checked_tensors" not in stats.metrics
    finally:
        transport.close()
    assert _info(urls[0])["groups"] == [] and _info(urls[1])["groups"] == []
