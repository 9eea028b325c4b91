"""SGLang through the driver: the engine options `rollout_engines` builds reach SGLang as its own flags.

Launching runs `tests/engine/sglang_program`'s stand-in for `python -m sglang.launch_server` (it
parses SGLang's flag names and refuses any other, as the real server does); attaching talks to the
recording fake server of `sglang_fake.py`. Both go through `miles.driver.services.rollout_engines`
with a config built by `load_recipe`, as `miles run` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from engine.sglang_fake import FakeSGLang
from miles.config import load_recipe
from miles.driver.services import rollout_engines
from miles.engines.launchers import EmbeddedLauncher, sglang_command
from miles.errors import ConfigError
from miles.eval.dedicated import fleet_specs
from miles.interfaces import EngineSpec

PROGRAM = Path(__file__).parent / "sglang_program"


@pytest.fixture
def sglang_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make `sglang` importable here (the launcher checks) and in engine processes; the record file."""
    record = tmp_path / "launch_server.json"
    monkeypatch.syspath_prepend(str(PROGRAM))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PROGRAM), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MILES_FAKE_SGLANG_RECORD", str(record))
    return record


def _launch(tmp_path: Path, overrides: list[str]) -> list[str]:
    config = load_recipe("default", ["engine.launcher=sglang", *overrides])
    with rollout_engines(config, "/models/q", str(tmp_path / "logs"), str(tmp_path / "work")) as (urls, _):
        for url in urls:
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
        return urls


def test_the_driver_launches_sglang_with_the_runs_seed_as_random_seed(
    tmp_path: Path, sglang_program: Path
) -> None:
    [url] = _launch(tmp_path, ["run.seed=7"])
    recorded = json.loads(sglang_program.read_text())
    assert recorded["args"]["random_seed"] == 7
    assert recorded["args"]["port"] == int(url.rsplit(":", 1)[1])
    assert recorded["args"]["model_path"] == "/models/q"


def test_a_null_engine_seed_launches_sglang_without_one(tmp_path: Path, sglang_program: Path) -> None:
    _launch(tmp_path, ["run.seed=7", "engine.options.seed=null"])
    recorded = json.loads(sglang_program.read_text())
    assert recorded["args"]["random_seed"] is None
    assert not any("seed" in arg for arg in recorded["argv"])


def test_an_explicit_engine_seed_wins_and_zero_is_a_seed(tmp_path: Path, sglang_program: Path) -> None:
    _launch(tmp_path, ["run.seed=7", "engine.options.seed=0"])
    assert json.loads(sglang_program.read_text())["args"]["random_seed"] == 0


def test_the_driver_attaches_to_sglang_with_the_default_seed(tmp_path: Path) -> None:
    with FakeSGLang() as fake:
        urls = _launch(tmp_path, [f"engine.urls=[{fake.url}]"])
        assert urls == [fake.url]
        assert ("GET", "/health", None) in fake.requests
        # A null seed is "no seed", which an attached server takes as well.
        assert _launch(tmp_path, [f"engine.urls=[{fake.url}]", "engine.options.seed=null"]) == [fake.url]


def test_an_explicit_seed_for_an_attached_sglang_server_is_refused_clearly(tmp_path: Path) -> None:
    with FakeSGLang() as fake:
        with pytest.raises(
            ConfigError,
            match=rf"sglang engine 0 attaches to the running server at {fake.url}, which cannot take "
            r"option\(s\) \['seed'\].*--random-seed.*set them to null in engine\.options",
        ):
            _launch(tmp_path, [f"engine.urls=[{fake.url}]", "engine.options.seed=5"])
        assert fake.requests == []  # refused before anything is contacted


def test_sglang_command_maps_seed_to_random_seed() -> None:
    argv = sglang_command("py", EngineSpec(model_path="m", options={"seed": 0}), 9)
    assert argv[-2:] == ["--random-seed", "0"]
    assert "--random-seed" not in sglang_command("py", EngineSpec(model_path="m", options={"seed": None}), 9)


def test_the_dedicated_eval_fleet_gets_the_seed_only_when_it_is_launched() -> None:
    eval_section = "eval={data: {path: builtin:arith}, mode: dedicated}"
    [launched] = fleet_specs(load_recipe("default", [eval_section, "run.seed=3"]), "m")
    assert launched.options["seed"] == 3
    [attached] = fleet_specs(
        load_recipe("default", [eval_section, "eval.engine_options={url: 'http://127.0.0.1:9'}"]), "m"
    )
    assert "seed" not in attached.options


def test_the_embedded_launcher_refuses_a_seed_for_an_attached_engine_too(tmp_path: Path) -> None:
    spec = EngineSpec(model_path="m", options={"url": "http://127.0.0.1:9", "seed": 1, "dtype": "float32"})
    with pytest.raises(ConfigError, match=r"embedded engine 0 attaches .* option\(s\) \['seed'\].*--seed"):
        EmbeddedLauncher().launch([spec], str(tmp_path))
