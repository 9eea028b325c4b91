"""``train.lr_schedule`` in the megatron backend: the same rate as the FSDP backend's on every step."""

from __future__ import annotations

import pytest

from miles.config.schema import TrainSection
from miles.errors import ConfigError
from miles_fsdp import schedule as fsdp_schedule
from miles_megatron import schedule


@pytest.mark.parametrize(
    "train",
    [
        dict(),
        dict(warmup_steps=3),
        dict(lr_schedule="linear", warmup_steps=2),
        dict(lr_schedule="linear", lr_decay_steps=7),
        dict(lr_schedule="cosine", warmup_steps=1),
        dict(lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1, lr_decay_steps=9),
    ],
)
def test_the_multiplier_equals_the_fsdp_backends_on_every_step(train):
    opts = TrainSection(**train)
    config = {"run": {"num_steps": 10}}
    total = schedule.decay_steps(opts, config)
    assert total == fsdp_schedule.decay_steps(opts, config)
    ours, theirs = schedule.lr_multiplier(opts, total), fsdp_schedule.lr_multiplier(opts, total)
    values = [ours(s) for s in range(14)]
    assert values == pytest.approx([theirs(s) for s in range(14)], abs=1e-12)
    if opts.lr_schedule != "constant":
        assert values[-1] < values[opts.warmup_steps]  # it decays
    if opts.warmup_steps:
        assert values[0] == pytest.approx(1 / opts.warmup_steps)


def test_a_decay_without_a_span_is_refused():
    with pytest.raises(ConfigError, match=r"set train\.lr_decay_steps"):
        schedule.decay_steps(TrainSection(lr_schedule="linear"), None)
    with pytest.raises(ConfigError, match="leaves no optimizer step"):
        schedule.decay_steps(TrainSection(lr_schedule="cosine", warmup_steps=20), {"run": {"num_steps": 10}})
