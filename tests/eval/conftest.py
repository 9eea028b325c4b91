"""Evaluation test fixtures: a tiny model, a tiny eval set, one running engine for the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine.helpers import make_tiny_qwen3, running_engine

from eval.helpers import GATE, PROBE, SEEN, write_eval_data


@pytest.fixture(scope="session")
def eval_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("eval")


@pytest.fixture(scope="session")
def model_dir(eval_tmp: Path) -> Path:
    return make_tiny_qwen3(eval_tmp / "model", seed=0, tokenizer=True)


@pytest.fixture(scope="session")
def data_file(eval_tmp: Path) -> Path:
    return write_eval_data(eval_tmp / "eval.jsonl", n=4)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def engine_url(model_dir: Path, eval_tmp: Path) -> Iterator[str]:
    """One real embedded engine: the run's "rollout engine" in the shared-mode tests."""
    with running_engine(model_dir, eval_tmp / "engine-logs") as url:
        yield url


@pytest.fixture(autouse=True)
def _fresh_plugin_state() -> Iterator[None]:
    PROBE.reset()
    GATE.clear()
    SEEN.clear()
    yield
    GATE.set()  # never leave a backend thread waiting
