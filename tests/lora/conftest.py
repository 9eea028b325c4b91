"""Fixtures for the LoRA tests: a tiny random Qwen3 on disk and peft adapters of it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Rank processes import test components by path; they inherit sys.path.
TESTS_DIR = str(Path(__file__).resolve().parents[1])
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from engine.helpers import make_tiny_qwen3  # noqa: E402

from lora.helpers import make_adapter  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("lora-base"), tokenizer=True, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def adapters(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny_base, root / "a", seed=1, rank=4, targets=["q_proj", "v_proj", "down_proj"]),
        "b": make_adapter(tiny_base, root / "b", seed=2, rank=2, targets=["o_proj", "gate_proj"]),
    }
