"""``miles.config.sections.backend_sections``: a backend's ``train`` and own section of its spec's options."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from miles.config.sections import backend_sections
from miles.errors import ConfigError


class _Own(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ranks: int = 1


def test_both_sections_are_validated_and_defaults_fill_what_is_missing() -> None:
    train, own = backend_sections({"train": {"lr": 0.5}, "mine": {"ranks": 3}}, "mine", _Own)
    assert train.lr == 0.5 and own.ranks == 3
    train, own = backend_sections({}, "mine", _Own)
    assert own.ranks == 1


def test_a_bad_value_and_an_unknown_section_are_one_error_each_naming_the_backend() -> None:
    with pytest.raises(ConfigError, match=r"(?s)mine backend options are invalid.*ranks"):
        backend_sections({"mine": {"ranks": "many"}}, "mine", _Own)
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['fsdp'\]; allowed: train, mine"):
        backend_sections({"fsdp": {}}, "mine", _Own)
