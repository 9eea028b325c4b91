"""The router over a supervised fleet, without a run: two real embedded engines, one stopped or killed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from miles.driver.fleet import EngineFleet, FleetSettings
from miles.engines.client import SGLangClient
from miles.engines.launchers import EmbeddedLauncher
from miles.engines.router import Router
from miles.errors import EngineError
from miles.interfaces import EngineSpec
from miles.types import SamplingParams

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0)


@pytest.fixture(scope="module")
def fleet(dense_dir, tmp_path_factory):
    launcher = EmbeddedLauncher()
    spec = EngineSpec(model_path=str(dense_dir), options={"torch_threads": 1, "max_batch_size": 8})
    urls = launcher.launch([spec, spec], str(tmp_path_factory.mktemp("fleet-logs")))
    settings = FleetSettings(health_check_interval_s=0.2, health_timeout_s=1.0, max_restarts=5)
    fleet = EngineFleet(urls, {}, launcher, settings, str(tmp_path_factory.mktemp("fleet-work")))
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()
        launcher.shutdown()


def _wait_serving(fleet: EngineFleet, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(fleet.board.available_urls()) < len(fleet.urls):
        assert time.monotonic() < deadline, fleet.board.engines
        time.sleep(0.1)


def _pid(url: str) -> int:
    from miles.engines.client import call_engine

    return call_engine(url, "/get_server_info", method="GET")["pid"]


async def _generate_on(router: Router, key: str | None, sticky: bool):
    async with router.request(key, sticky=sticky) as route:
        out = await route.generate([1, 2, 3], PARAMS)
        return route.engine_index, out


def test_a_stopped_engines_request_is_cut_and_retried_on_the_other(fleet):
    _wait_serving(fleet)
    stopped = fleet.urls[0]
    os.kill(_pid(stopped), signal.SIGSTOP)

    async def go():
        clients = [SGLangClient(u) for u in fleet.urls]
        router = Router(clients)
        try:
            # The first request goes to engine 0 (the least used): it hangs there until the
            # health check finds the engine hung and cuts it; then it runs on engine 1.
            t0 = time.monotonic()
            index, out = await _generate_on(router, None, False)
            return index, out, time.monotonic() - t0
        finally:
            for c in clients:
                await c.aclose()

    retried = fleet.board.retried_requests
    index, out, seconds = asyncio.run(go())
    assert index == 1 and len(out.output_ids) >= 1
    assert fleet.board.retried_requests == retried + 1
    assert seconds < 10.0
    _wait_serving(fleet)  # killed, restarted (same URL), back at version 0
    assert fleet.metrics()["engine/restarts"] >= 1


def test_a_sticky_session_moves_when_its_engine_dies(fleet):
    _wait_serving(fleet)

    async def go():
        clients = [SGLangClient(u) for u in fleet.urls]
        router = Router(clients)
        try:
            first, _ = await _generate_on(router, "session-1", True)
            os.kill(_pid(fleet.urls[first]), signal.SIGKILL)
            second, _ = await _generate_on(router, "session-1", True)
            third, _ = await _generate_on(router, "session-1", True)
            return first, second, third
        finally:
            for c in clients:
                await c.aclose()

    first, second, third = asyncio.run(go())
    assert second != first and third == second  # moved once, then stays
    _wait_serving(fleet)


def test_an_error_the_engine_answers_with_is_not_retried(fleet):
    _wait_serving(fleet)

    async def go():
        clients = [SGLangClient(u) for u in fleet.urls]
        router = Router(clients)
        try:
            async with router.request(None, sticky=False) as route:
                await route.generate([10**9], PARAMS)  # a token id outside the vocabulary: HTTP 400
        finally:
            for c in clients:
                await c.aclose()

    retried = fleet.board.retried_requests
    with pytest.raises(EngineError) as info:
        asyncio.run(go())
    assert "HTTP 4" in str(info.value)
    assert fleet.board.retried_requests == retried


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["engine.urls=[http://127.0.0.1:1]"], "Miles did not start them and cannot restart them"),
        (["placement.launcher=ray"], "placement.launcher 'ray' does not restart engines yet"),
        (["transport=p2p"], "transport 'p2p' cannot re-form its connections"),
    ],
)
def test_restarts_these_engines_cannot_take_are_refused_in_one_line(overrides, reason):
    from miles.config import load_recipe
    from miles.driver.fleet import settings_from
    from miles.errors import ConfigError

    config = load_recipe("default", [*overrides, "engine.max_restarts=2"])
    with pytest.raises(ConfigError, match=reason):
        settings_from(config)
    # Left unset, the same recipe runs with restarts off instead of being refused.
    assert settings_from(load_recipe("default", overrides)).max_restarts == 0
