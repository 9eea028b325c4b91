"""Fixtures for the transport tests: real embedded engines serving a tiny Qwen3, and a hand-off directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = str(Path(__file__).resolve().parents[1])
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from fsdp.helpers import build_tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("engine-model"), seed=0, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def handoff_dir() -> str:
    import shutil

    from miles_transports.colocated import make_handoff_dir

    path = make_handoff_dir(prefix="miles-test-handoff-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def engines(engine_model: str, handoff_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two embedded engines (real processes) sharing one hand-off directory."""
    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec

    launcher = EmbeddedLauncher(startup_timeout_s=120)
    options = {"handoff_dir": handoff_dir, "torch_threads": 1, "max_batch_size": 4}
    try:
        urls = launcher.launch(
            [EngineSpec(model_path=engine_model, options=dict(options)) for _ in range(2)],
            str(tmp_path_factory.mktemp("engine-logs")),
        )
        yield urls
    finally:
        launcher.shutdown()
