"""Shared test setup: one torch thread (the CI machine has 2 shared cores) and a repo-local model cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Set before torch is imported anywhere (subprocesses inherit it too).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MILES_TORCH_THREADS", "1")
os.environ.setdefault("MILES_CACHE_DIR", str(ROOT / ".miles-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["plugin_fixtures"]  # the fake_site fixture: real *.dist-info dirs on sys.path


@pytest.fixture
def backend_factory():
    """Start FSDPBackends and always shut them down (ranks are real processes)."""
    from miles_fsdp.backend import FSDPBackend

    started = []

    def start(spec):
        b = FSDPBackend()
        started.append(b)
        b.setup(spec)
        return b

    yield start
    for b in started:
        b.shutdown()
