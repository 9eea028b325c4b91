"""The rank hooks at the unit that calls them: a real ``RankTrainer`` (tiny model, gloo, one rank) in this process.

Each test starts from a fresh plugin manager, as a rank process does: nothing that the
driver (or an earlier test) configured reaches it except through ``BackendSpec.config``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from fsdp.helpers import make_batch, make_spec
from miles import hookimpl
from miles.config.sections import ConfigSection
from miles.interfaces import CorrectionOutput, LossInputs, LossOutput
from miles.plugins import get_plugin_manager, reset_plugin_state

LOSS = "fsdp.components:ReportedPGLoss"


@pytest.fixture
def process_group() -> Iterator[None]:
    import torch.distributed as dist

    from miles_fsdp.ranks import free_port

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fresh_plugins() -> Iterator[None]:
    reset_plugin_state()
    yield
    reset_plugin_state()


@pytest.fixture
def trainer(tiny_model: str, process_group: None, fresh_plugins: None):
    """Build a ``RankTrainer`` with the given plugin objects registered (unregistered afterwards)."""
    from miles_fsdp.rank import RankTrainer

    pm = get_plugin_manager()
    registered: list[Any] = []
    built: list[RankTrainer] = []

    def build(*plugins: Any, config: dict[str, Any] | None = None, **spec: Any) -> RankTrainer:
        for plugin in plugins:
            pm.register(plugin)
            registered.append(plugin)
        spec.setdefault("loss", LOSS)
        # One micro-batch holds the whole batch, so each step's metrics are that micro-batch's.
        made = make_spec(tiny_model, train={"micro_batch_size": 8}, config=config, **spec)
        built.append(RankTrainer(made, rank=0, world_size=1))
        return built[-1]

    yield build
    for t in built:
        t.close()
    for plugin in registered:
        pm.unregister(plugin)


def _step(trainer: Any) -> dict[str, float]:
    from miles_fsdp.batching import split_batch

    [share] = split_batch(make_batch(5, seed=3), 1, 8)
    assert len(share.micro_batches) == 1
    return trainer.train_step(share)


class ConstantTerm:
    """Adds a constant term (no gradient): its value is known exactly."""

    def __init__(self, name: str, value: float) -> None:
        self.name, self.value = name, value

    @hookimpl
    def miles_loss_terms(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        return {self.name: torch.tensor(self.value)}


class LogprobTerm:
    """A term with a gradient (a likelihood bonus), only for policy losses; records the kinds it saw."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    @hookimpl
    def miles_loss_terms(self, inputs: LossInputs, kind: str) -> dict[str, torch.Tensor] | None:
        self.kinds.append(kind)
        if kind != "policy":
            return None
        return {"likelihood": -0.5 * (inputs.logprobs * inputs.loss_mask).sum() / inputs.num_loss_tokens}


class AddViaPostprocess:
    """The pre-existing pattern: return a replacement ``LossOutput`` with one more term."""

    def __init__(self, name: str, value: float) -> None:
        self.name, self.value = name, value

    @hookimpl
    def miles_loss_postprocess(self, output: LossOutput, inputs: LossInputs) -> LossOutput:
        return LossOutput(loss=output.loss + self.value, metrics={**output.metrics, self.name: self.value})


def test_two_plugins_loss_terms_compose_and_are_logged(trainer) -> None:
    plain = _step(trainer())
    assert plain["train/loss"] == pytest.approx(plain["loss/base"], rel=1e-6)

    bonus = LogprobTerm()
    metrics = _step(trainer(ConstantTerm("offset", 0.25), bonus))
    assert metrics["loss/offset"] == 0.25
    # The likelihood term is -0.5 x the mean log-prob of the trained tokens (one micro-batch).
    assert metrics["loss/likelihood"] == pytest.approx(-0.5 * metrics["loss/mean_logprob"], rel=1e-6)
    assert metrics["train/loss"] == pytest.approx(
        metrics["loss/base"] + 0.25 + metrics["loss/likelihood"], rel=1e-6
    )
    assert bonus.kinds == ["policy"]


def test_postprocess_replacements_chain(trainer) -> None:
    class InPlace:
        @hookimpl
        def miles_loss_postprocess(self, output: LossOutput) -> None:
            output.loss = output.loss * 2.0  # mutates and returns None: the chain goes on with it
            output.metrics["doubled"] = 1.0

    # pluggy calls the last registered first: InPlace, then 'second', then 'first'.
    metrics = _step(trainer(AddViaPostprocess("first", 0.5), AddViaPostprocess("second", 0.125), InPlace()))
    assert metrics["loss/first"] == 0.5 and metrics["loss/second"] == 0.125 and metrics["loss/doubled"] == 1.0
    assert metrics["train/loss"] == pytest.approx(2.0 * metrics["loss/base"] + 0.5 + 0.125, rel=1e-6)


def test_terms_are_added_before_the_postprocess_chain(trainer) -> None:
    seen: list[float] = []

    class Observer:
        @hookimpl
        def miles_loss_postprocess(self, output: LossOutput, kind: str) -> None:
            assert kind == "policy"
            seen.append(float(output.loss.detach()))

    metrics = _step(trainer(ConstantTerm("offset", 1.5), Observer()))
    assert seen == [pytest.approx(metrics["loss/base"] + 1.5, rel=1e-6)]


def test_correction_postprocess_mutation_reaches_the_loss(trainer) -> None:
    class Quarter:
        @hookimpl
        def miles_correction_postprocess(self, output: CorrectionOutput, loss_mask: torch.Tensor) -> None:
            assert output.weights.shape == loss_mask.shape
            output.weights.mul_(0.5)
            output.metrics["halved"] = 1.0

    metrics = _step(trainer(Quarter(), correction="fsdp.components:HalfCorrection"))
    assert metrics["correction/weight_mean"] == 0.5 and metrics["correction/halved"] == 1.0
    assert metrics["loss/trained_weight_mean"] == pytest.approx(0.25)  # 0.5 from the correction, halved


# ---------------------------------------------------------------- configuration


class WeightOptions(BaseModel):
    weight: float = 0.0


class ConfiguredTerm:
    """Configures itself from its own recipe section in miles_configure and adds a term of that weight."""

    def __init__(self) -> None:
        self.weight = WeightOptions().weight
        self.configured = 0

    @hookimpl
    def miles_config_sections(self) -> list[ConfigSection]:
        return [ConfigSection(name="rank_term", model=WeightOptions)]

    @hookimpl
    def miles_configure(self, config: Any) -> None:
        self.configured += 1
        self.weight = config.rank_term.weight

    @hookimpl
    def miles_loss_terms(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        return {"configured": torch.tensor(self.weight)}


def test_rank_configures_plugins_from_the_spec_config(trainer) -> None:
    from miles.config import load_recipe

    plugin = ConfiguredTerm()
    get_plugin_manager().register(plugin)
    try:
        config = load_recipe("default", ["rank_term.weight=0.75"]).model_dump(mode="json")
    finally:
        get_plugin_manager().unregister(plugin)
    assert plugin.configured == 0  # loading a recipe configures nothing

    metrics = _step(trainer(plugin, config=config))
    assert plugin.configured == 1 and plugin.weight == 0.75
    assert metrics["loss/configured"] == 0.75  # the recipe's value, in the loss term of the rank


def test_rank_without_a_config_configures_nothing(trainer) -> None:
    plugin = ConfiguredTerm()
    metrics = _step(trainer(plugin))
    assert plugin.configured == 0 and metrics["loss/configured"] == 0.0


def test_rank_refuses_a_config_its_plugins_cannot_validate(trainer) -> None:
    from miles.config import load_recipe
    from miles.errors import ConfigError

    plugin = ConfiguredTerm()
    get_plugin_manager().register(plugin)
    try:
        config = load_recipe("default", ["rank_term.weight=0.75"]).model_dump(mode="json")
    finally:
        get_plugin_manager().unregister(plugin)
    # This "rank" lacks the plugin that contributes the rank_term section.
    with pytest.raises(ConfigError, match="plugins differ from the driver's"):
        trainer(config=config)
