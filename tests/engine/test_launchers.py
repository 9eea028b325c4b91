"""Launchers: port checks before spawning, startup failures with the engine's log, SGLang attach/launch."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.sglang_fake import FakeSGLang
from miles.engines.launchers import EmbeddedLauncher, SGLangLauncher, free_port, port_is_free, sglang_command
from miles.errors import ConfigError, EngineError
from miles.interfaces import EngineLauncher, EngineSpec


def test_launchers_satisfy_the_protocol() -> None:
    assert isinstance(EmbeddedLauncher(), EngineLauncher)
    assert isinstance(SGLangLauncher(), EngineLauncher)


def test_a_taken_port_fails_before_anything_starts(tmp_path: Path) -> None:
    dense_dir = tmp_path / "model"  # the port is refused before the model is even read
    dense_dir.mkdir()
    (dense_dir / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        launcher = EmbeddedLauncher()
        specs = [EngineSpec(model_path=str(dense_dir)), EngineSpec(model_path=str(dense_dir), port=port)]
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=rf"engine 1: port {port} on 127.0.0.1 is already in use"):
            launcher.launch(specs, str(tmp_path))
        assert time.monotonic() - t0 < 2 and launcher.pids == []
        # The engine process itself refuses the port too, at once and in one line.
        r = subprocess.run(
            [sys.executable, "-m", "miles.engines.embedded", "--model", str(dense_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0 and f"port {port} on 127.0.0.1 is already in use" in r.stderr


def test_an_engine_that_dies_while_starting_reports_its_log(tmp_path: Path) -> None:
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    launcher = EmbeddedLauncher()
    with pytest.raises(
        EngineError,
        match=r"exited with code 1 while starting; log .*engine-0.log ends with:\n.*"
        r"not a Hugging Face model directory",
    ):
        launcher.launch([EngineSpec(model_path=str(not_a_model))], str(tmp_path / "logs"))
    assert (tmp_path / "logs" / "engine-0.log").exists()


def test_bad_options_and_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['max_batch'\]"):
        EmbeddedLauncher().launch(
            [EngineSpec(model_path=str(tmp_path), options={"max_batch": 4})], str(tmp_path)
        )
    with pytest.raises(EngineError, match="is not a directory"):
        EmbeddedLauncher().launch([EngineSpec(model_path=str(tmp_path / "nope"))], str(tmp_path))
    assert EmbeddedLauncher().command(
        EngineSpec(model_path="m", options={"dtype": "bfloat16", "seed": 3}), 9
    )[3:] == [
        "--model",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        "9",
        "--parent-pid",
        str(__import__("os").getpid()),
        "--dtype",
        "bfloat16",
        "--seed",
        "3",
    ]


def test_sglang_attach_checks_health(tmp_path: Path) -> None:
    with FakeSGLang() as fake:
        urls = SGLangLauncher().launch(
            [EngineSpec(model_path="m", options={"url": fake.url + "/"})], str(tmp_path)
        )
        assert urls == [fake.url]
        assert fake.requests == [("GET", "/health", None)]
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=rf"engine {dead} is not healthy"):
        SGLangLauncher().launch(
            [EngineSpec(model_path="m", options={"url": dead, "startup_timeout_s": 1})], str(tmp_path)
        )


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_sglang_launch_without_sglang_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"miles-core\[sglang\].*engine\.urls"):
        SGLangLauncher().launch([EngineSpec(model_path="m")], str(tmp_path))


def test_sglang_command_line() -> None:
    spec = EngineSpec(
        model_path="/models/q",
        options={
            "dtype": "bfloat16",
            "tp_size": 2,
            "enable_return_routed_experts": True,
            "extra_args": ["--mem-fraction-static", "0.7"],
        },
    )
    assert sglang_command("py", spec, 30001) == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/q",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--dtype",
        "bfloat16",
        "--tp-size",
        "2",
        "--enable-return-routed-experts",
        "--mem-fraction-static",
        "0.7",
    ]
