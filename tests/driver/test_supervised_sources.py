"""``mode: sft`` beyond chat data: a data source that makes its own samples (``SupervisedSampleSource``)
and the check that the backend trains that sample kind (``supervised_kinds``)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from miles.builtins.data.records import PromptPool
from miles.capabilities import backend_supervised_kinds, check_supervised_kinds, supervised_kind
from miles.driver.components import SharedDataSource
from miles.driver.sft import SFTStage
from miles.errors import ConfigError
from miles.interfaces import TOKEN_SAMPLES, SupervisedSampleSource
from miles.types import Prompt, Sample, Status


class WidgetSource(PromptPool):
    """Items that are not conversations: each sample carries a payload the core never reads."""

    sample_kind = "widget"

    def __init__(self) -> None:
        super().__init__(
            [Prompt(index=i, prompt=str(i)) for i in range(5)], shuffle=False, seed=0, name="widgets"
        )

    def supervised_sample(self, prompt: Prompt) -> Sample:
        return Sample(prompt=prompt, payload=("widget", prompt.index), status=Status.COMPLETED)


class ConversationSource(PromptPool):
    def __init__(self) -> None:
        super().__init__([Prompt(index=0, prompt="hi")], shuffle=False, seed=0, name="chat")


def test_a_source_that_makes_its_samples_gives_payload_batches_without_tokens() -> None:
    source = WidgetSource()
    assert isinstance(source, SupervisedSampleSource)
    stage = SFTStage(SharedDataSource(source), source.supervised_sample, batch_size=3, tokens=False)
    batch, metrics = stage.next_batch(step=4)
    assert batch is not None and batch.step == 4
    assert [s.payload for s in batch.samples] == [("widget", 0), ("widget", 1), ("widget", 2)]
    assert batch.advantages == [[0.0], [0.0], [0.0]]  # one row entry per sample, no tokens
    assert (
        metrics["sft/samples"] == 3
        and "sft/seq_len_mean" not in metrics
        and "sft/conversations" not in metrics
    )


def test_the_sample_kind_of_a_source_and_the_kinds_a_backend_trains() -> None:
    assert supervised_kind(SharedDataSource(WidgetSource())) == "widget"  # through the driver's wrapper
    assert supervised_kind(ConversationSource()) == TOKEN_SAMPLES

    class TokenBackend:
        pass

    class WidgetBackend:
        supervised_kinds = frozenset({"widget"})

    class Malformed:
        supervised_kinds = ("widget",)

    assert backend_supervised_kinds(TokenBackend) == frozenset({TOKEN_SAMPLES})
    assert backend_supervised_kinds(WidgetBackend) == frozenset({"widget"})
    with pytest.raises(ConfigError, match="expected a frozenset of str"):
        backend_supervised_kinds(Malformed)


def test_a_source_of_another_kind_than_the_backend_trains_is_refused() -> None:
    config = SimpleNamespace(backend="fsdp", data=SimpleNamespace(source="widgets"))
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "data.source 'widgets' yields 'widget' samples for mode: sft, but backend 'fsdp' trains 'tokens'"
        ),
    ):
        check_supervised_kinds(config, WidgetSource())  # type: ignore[arg-type]
    check_supervised_kinds(config, ConversationSource())  # type: ignore[arg-type]
