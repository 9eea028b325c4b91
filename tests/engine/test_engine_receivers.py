"""Engine receivers are plugins: found through ``miles.engine_receivers``, mounted by the embedded engine.

A throw-away distribution (a real ``*.dist-info`` in a fake site, see ``plugin_fixtures``)
declares a receiver with a launch option, and another one whose module fails to import. A real
engine process started by the real launcher gets the option as a flag, answers on the receiver's
route, and starts although the second receiver is broken; a run whose transport needs the broken
one is refused with its import error. The receivers moved out of core (disk-delta, p2p) are
listed by ``miles plugins`` as miles-transports'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from plugin_fixtures import FakeSite

from engine.helpers import running_engine

RECIPE = str(Path(__file__).parent.parent / "data" / "recipes" / "tiny.yaml")

ECHO_RECEIVER = """
from fastapi import APIRouter

from miles.engines.embedded.receivers import EngineReceiver, ReceiverOption, ok


def mount(app, engine, options):
    router = APIRouter()

    @router.get("/echo_receiver")
    async def echo():
        return ok("echo", note=options["echo_note"], weight_version=engine.weight_version)

    app.include_router(router)


RECEIVER = EngineReceiver(
    name="echo", mount=mount, options=(ReceiverOption("echo_note", "what /echo_receiver answers"),)
)
"""

TRANSPORT_NEEDING_BROKEN = """
from miles.capabilities import TransportNeeds


class NeedsBroken:
    needs = TransportNeeds(receiver="broken-rx")
"""


@pytest.fixture
def receiver_site(fake_site: FakeSite) -> FakeSite:
    fake_site.module("fake_echo_receiver", ECHO_RECEIVER)
    fake_site.module("fake_broken_receiver", "import fake_receiver_missing_dependency\n")
    fake_site.module("fake_needs_broken", TRANSPORT_NEEDING_BROKEN)
    fake_site.dist(
        "miles-fake-receivers",
        "0.1",
        {
            "miles.engine_receivers": {
                "echo": "fake_echo_receiver:RECEIVER",
                "broken-rx": "fake_broken_receiver:RECEIVER",
            }
        },
    )
    return fake_site


def test_installed_receivers_become_the_embedded_engines_capabilities(receiver_site: FakeSite) -> None:
    from miles.engines.embedded.receivers import installed_receivers
    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec

    found = installed_receivers()
    assert {"echo", "disk-delta", "p2p"} <= set(found.loaded)
    assert "fake_receiver_missing_dependency" in found.broken["broken-rx"]
    caps = EmbeddedLauncher.capabilities
    assert {"echo", "disk-delta", "p2p", "weight-group", "handoff-files"} <= caps.receivers
    assert "broken-rx" not in caps.receivers
    assert dict(caps.unavailable)["broken-rx"] == found.broken["broken-rx"]
    # The launcher takes the receivers' options and passes them on as flags.
    spec = EngineSpec(model_path="model", options={"echo_note": "hi", "delta_root": "/deltas"})
    argv = EmbeddedLauncher().command(spec, 30000)
    assert argv[argv.index("--echo-note") + 1] == "hi"
    assert argv[argv.index("--delta-root") + 1] == "/deltas"


def test_a_run_needing_a_broken_receiver_is_refused_with_its_error(receiver_site: FakeSite) -> None:
    from miles.capabilities import check_needs
    from miles.config import load_recipe
    from miles.errors import ConfigError

    config = load_recipe(RECIPE, ["transport=fake_needs_broken:NeedsBroken"])
    with pytest.raises(ConfigError) as info:
        check_needs(config)
    message = str(info.value)
    assert "engine-side 'broken-rx' receiver" in message
    assert "could not load" in message and "fake_receiver_missing_dependency" in message


def test_a_running_engine_mounts_an_installed_receiver(
    receiver_site: FakeSite, dense_dir: Path, tmp_path: Path
) -> None:
    env = {
        # The engine process finds the fake distribution as an installed one.
        "PYTHONPATH": os.pathsep.join([str(receiver_site.root), os.environ.get("PYTHONPATH", "")]),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # stevedore's entry-point cache for this sys.path
    }
    log_dir = tmp_path / "logs"
    with running_engine(dense_dir, log_dir, env=env, echo_note="hello", delta_root=str(tmp_path)) as url:
        r = httpx.get(url + "/echo_receiver", trust_env=False)
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "message": "echo", "note": "hello", "weight_version": "0"}
        # The receivers of miles-transports are mounted next to it: disk-delta answers (and refuses
        # a version that is not there), p2p validates its body.
        r = httpx.post(url + "/update_weights_from_disk_delta", json={"version": 1}, trust_env=False)
        assert r.status_code == 400 and "v000001" in r.json()["message"], r.text
        r = httpx.post(url + "/p2p/init", json={}, trust_env=False)
        assert r.status_code == 400 and "bucket_bytes" in r.json()["message"], r.text
    log = (log_dir / "engine-0.log").read_text()
    assert "engine receiver 'broken-rx' is not available" in log
    assert "fake_receiver_missing_dependency" in log


def test_an_engine_without_a_receiver_has_no_route_for_it(dense_dir: Path) -> None:
    """Mounting is what gives the engine a receiver's route: with none mounted it is a 404."""
    import asyncio

    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions
    from miles.engines.embedded.receivers import InstalledReceivers
    from miles.engines.embedded.server import create_app

    engine = EmbeddedEngine(EngineOptions(model_path=str(dense_dir), dtype="float32"))
    engine.start()

    async def post() -> httpx.Response:
        app = create_app(engine, InstalledReceivers(loaded={}, broken={}))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            return await http.post("/update_weights_from_disk_delta", json={"version": 1})

    try:
        r = asyncio.run(post())
    finally:
        engine.stop()
    assert r.status_code == 404


def test_miles_plugins_lists_the_transports_receivers() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "miles", "plugins", "--json"], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    import json

    rows = {row["distribution"]: row for row in json.loads(out.stdout)}
    transports = rows["miles-transports"]
    assert {"engine_receiver:disk-delta", "engine_receiver:p2p"} <= set(transports["provides"])
    assert transports["status"] == "active"
