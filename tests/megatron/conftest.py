"""Fixtures shared by the Megatron backend's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from megatron_helpers import make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen3 checkpoint with an untied output layer, one per test module."""
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), tie_word_embeddings=False)


@pytest.fixture
def backends() -> Iterator[Callable[[Any], Any]]:
    """``start(spec)``: a ``MegatronBackend`` set up for ``spec``; every one started is shut down after the test."""
    from miles_megatron.backend import MegatronBackend

    started: list[Any] = []

    def start(spec: Any) -> Any:
        backend = MegatronBackend()
        started.append(backend)
        backend.setup(spec)
        return backend

    yield start
    for backend in started:
        backend.shutdown()
