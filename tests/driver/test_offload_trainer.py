"""placement.offload_trainer: a colocated run offloads the trainer around each rollout unless told not to."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config import load_recipe
from miles.driver.services import offloaded_while

RECIPE = str(Path(__file__).parent.parent / "data" / "recipes" / "tiny.yaml")


class RecordingBackend:
    """Only what offloaded_while calls; it records the order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def offload(self) -> None:
        self.calls.append("offload")

    def onload(self) -> None:
        self.calls.append("onload")


@pytest.mark.parametrize(
    ("offload", "expected"), [(True, ["offload", "rollout", "onload"]), (False, ["rollout"])]
)
def test_colocated_trainer_offload_follows_the_setting(offload: bool, expected: list[str]) -> None:
    config = load_recipe(RECIPE, ["transport=colocated", f"placement.offload_trainer={str(offload).lower()}"])
    backend = RecordingBackend()
    with offloaded_while(config, backend):
        backend.calls.append("rollout")
    assert backend.calls == expected


def test_disaggregated_runs_never_offload() -> None:
    config = load_recipe(RECIPE, ["transport=broadcast"])
    backend = RecordingBackend()
    with offloaded_while(config, backend):
        pass
    assert backend.calls == []
