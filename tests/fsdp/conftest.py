"""Fixtures for the FSDP backend tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Rank processes are spawned and import the test components by path (``fsdp.components:PGLoss``);
# they inherit sys.path, so make sure the tests/ folder is on it whatever pytest's import mode.
TESTS_DIR = str(Path(__file__).resolve().parents[1])
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from fsdp.helpers import build_tiny_qwen3  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3")))
