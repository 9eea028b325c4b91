"""Faults during a weight update: an engine that dies mid-broadcast is reported, nothing hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest

from miles.errors import EngineError
from transports.test_transports import new_weights

pytestmark = pytest.mark.slow


def test_an_engine_that_dies_mid_broadcast_fails_the_update_with_its_url(engine_model, tmp_path) -> None:
    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec
    from miles_transports.broadcast import BroadcastTransport

    launcher = EmbeddedLauncher(startup_timeout_s=120)
    options = {"torch_threads": 1, "max_batch_size": 4}
    try:
        urls = launcher.launch([EngineSpec(model_path=engine_model, options=dict(options))], str(tmp_path))
        [pid] = launcher.pids
        weights = new_weights(engine_model, seed=2)

        def stream():
            # The engine is killed while the trainer is still streaming: after the first buckets went out.
            for i, item in enumerate(weights.items()):
                if i == 6:
                    os.kill(pid, signal.SIGKILL)
                yield item

        transport = BroadcastTransport(bucket_mb=4096 / (1 << 20), timeout_s=30)
        transport.connect(urls, rank=0, world_size=1, device="cpu")
        t0 = time.monotonic()
        try:
            with pytest.raises(EngineError, match=urls[0]):
                transport.send(stream(), version=1)
        finally:
            transport.close()
        assert time.monotonic() - t0 < 60  # reported, not hung until some far-away timeout
    finally:
        launcher.shutdown()
