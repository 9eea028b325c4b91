"""The embedded engine launched as a Ray actor's process: answers /generate, leaves nothing behind."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from miles.engines.launchers import EmbeddedLauncher
from miles.interfaces import EngineSpec
from miles.placement import RayEngineLauncher

ENGINE_GROUP = "miles-test-engines"


def _groups(name: str) -> list[str]:
    from ray.util import placement_group_table

    return [g["state"] for g in placement_group_table().values() if g["name"] == name]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_embedded_engine_on_ray_generates_and_shuts_down_cleanly(ray_cluster, tiny_model, tmp_path):
    import ray

    free_cpus = ray.available_resources().get("CPU", 0.0)
    launcher = RayEngineLauncher(EmbeddedLauncher(), {"CPU": 1}, name=ENGINE_GROUP)
    options = {"device": "cpu", "dtype": "float32", "torch_threads": 1, "startup_timeout_s": 120}
    try:
        [url] = launcher.launch([EngineSpec(model_path=tiny_model, options=options)], str(tmp_path / "logs"))
        assert url.startswith("http://127.0.0.1:")  # the node's address on a single-machine cluster
        assert _groups(ENGINE_GROUP) == ["CREATED"]
        assert ray.available_resources().get("CPU", 0.0) == free_cpus - 1
        [pid] = launcher.pids
        assert pid != os.getpid() and _alive(pid)
        with httpx.Client(timeout=60, trust_env=False) as http:
            r = http.post(
                url + "/generate",
                json={
                    "input_ids": [3, 5, 7, 9],
                    "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True},
                    "return_logprob": True,
                },
            )
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["output_ids"]) == 4
        assert len(body["meta_info"]["output_token_logprobs"]) == 4
        assert (tmp_path / "logs" / "engine-0.log").is_file()  # logs land where local engines' do

        # Attaching to a running engine goes through the inner launcher only: no Ray, no new group.
        attach = RayEngineLauncher(EmbeddedLauncher(), {"CPU": 1}, name=ENGINE_GROUP + "-attach")
        assert attach.launch([EngineSpec(model_path=tiny_model, options={"url": url})], str(tmp_path)) == [
            url
        ]
        attach.shutdown()
        assert _groups(ENGINE_GROUP + "-attach") == []
    finally:
        launcher.shutdown()
    assert not _alive(pid)  # the engine process is gone, not orphaned
    assert _groups(ENGINE_GROUP) == ["REMOVED"]
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0.0) != free_cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) == free_cpus  # the bundle came back


def test_an_engine_that_cannot_start_fails_the_launch_and_gives_its_bundle_back(ray_cluster, tmp_path):
    launcher = RayEngineLauncher(EmbeddedLauncher(), {"CPU": 1}, name=ENGINE_GROUP + "-bad")
    spec = EngineSpec(model_path=str(tmp_path / "missing"), options={"device": "cpu"})
    from miles.errors import EngineError

    with pytest.raises(EngineError, match="is not a directory"):
        launcher.launch([spec], str(tmp_path / "logs"))
    assert _groups(ENGINE_GROUP + "-bad") == ["REMOVED"]


def test_unknown_engine_options_fail_before_ray_is_asked(ray_cluster, tiny_model, tmp_path):
    from miles.errors import ConfigError

    launcher = RayEngineLauncher(EmbeddedLauncher(), {"CPU": 1}, name=ENGINE_GROUP + "-opts")
    with pytest.raises(ConfigError, match="no_such_option"):
        launcher.launch([EngineSpec(model_path=tiny_model, options={"no_such_option": 1})], str(tmp_path))
    assert _groups(ENGINE_GROUP + "-opts") == []
