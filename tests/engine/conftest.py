"""Engine test fixtures: tiny random models written to a temporary directory per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.helpers import make_tiny_qwen3


@pytest.fixture(scope="session")
def engine_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="session")
def dense_dir(engine_tmp: Path) -> Path:
    return make_tiny_qwen3(engine_tmp / "dense-seed0", seed=0, tokenizer=True)
