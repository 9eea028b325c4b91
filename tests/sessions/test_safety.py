"""Runs with sessions refuse the abort in-flight update mode."""

from __future__ import annotations

import typing

import pytest

from miles.config.schema import FullyAsyncSection
from miles.errors import ConfigError
from miles_envs.sessions import SESSION_UPDATE_MODES, check_update_mode


def test_abort_is_refused_with_the_setting_and_the_allowed_modes() -> None:
    with pytest.raises(ConfigError) as info:
        check_update_mode("abort")
    text = str(info.value)
    assert "fully_async.update_mode" in text and "'retract'" in text and "'in_place'" in text
    assert "mid" in text or "middle" in text


@pytest.mark.parametrize("mode", SESSION_UPDATE_MODES)
def test_retract_and_in_place_are_allowed(mode: str) -> None:
    check_update_mode(mode)


def test_unknown_modes_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown fully_async\.update_mode 'pause'"):
        check_update_mode("pause")


def test_the_allowed_modes_are_the_configs_modes_minus_abort() -> None:
    modes = typing.get_args(FullyAsyncSection.model_fields["update_mode"].annotation)
    assert set(modes) - {"abort"} == set(SESSION_UPDATE_MODES)
