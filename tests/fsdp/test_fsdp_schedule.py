"""Learning-rate schedules (``train.lr_schedule``): transformers' functions, warmup, resume."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fsdp.helpers import make_batch, make_spec
from miles.config.schema import TrainSection
from miles.errors import ConfigError
from miles.lr_schedule import decay_steps, lr_multiplier


def _hf_factors(name: str, warmup: int, total: int, n: int, **kwargs) -> list[float]:
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_scheduler(
        name, opt, num_warmup_steps=warmup, num_training_steps=total, scheduler_specific_kwargs=kwargs or None
    )
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_constant_schedule_is_the_old_warmup_formula():
    for warmup in (0, 1, 4):
        f = lr_multiplier(TrainSection(warmup_steps=warmup), None)
        old = [min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0 for s in range(10)]
        assert [f(s) for s in range(10)] == old
        # the closed form is transformers' constant_with_warmup under the first-step convention
        hf = _hf_factors("constant_with_warmup", warmup, 10, 11)
        expected = [hf[s + 1] if s < warmup else hf[s] for s in range(10)]
        assert [f(s) for s in range(10)] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("schedule", "hf_name", "extra"),
    [
        ("linear", "linear", {}),
        ("cosine", "cosine", {}),
        ("cosine", "cosine_with_min_lr", {"min_lr_ratio": 0.1}),
    ],
)
@pytest.mark.parametrize("warmup", [0, 3])
def test_decay_is_transformers_schedule_and_warmup_starts_above_zero(schedule, hf_name, extra, warmup):
    total = 10
    train = TrainSection(lr_schedule=schedule, warmup_steps=warmup, lr_decay_steps=total, **extra)
    f = lr_multiplier(train, decay_steps(train, None))
    hf_kwargs = {"min_lr_rate": extra["min_lr_ratio"]} if extra else {}
    hf = _hf_factors(hf_name, warmup, total, total, **hf_kwargs)
    ours = [f(s) for s in range(total)]
    assert ours[warmup:] == pytest.approx(hf[warmup:], abs=1e-12)  # the decay, unchanged
    assert ours[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert all(x > 0 for x in ours)  # no optimizer step is wasted at lr 0
    assert ours[-1] < 0.5 and ours[-1] >= extra.get("min_lr_ratio", 0.0)


def test_decay_spans_the_run_unless_told_and_bad_settings_fail_once():
    train = TrainSection(lr_schedule="cosine", steps_per_rollout=2)
    assert decay_steps(train, {"run": {"num_steps": 7}}) == 14
    assert decay_steps(TrainSection(), None) is None
    with pytest.raises(ConfigError, match="lr_decay_steps"):
        decay_steps(train, None)
    with pytest.raises(ConfigError, match="warmup_steps"):
        decay_steps(TrainSection(lr_schedule="linear", warmup_steps=20), {"run": {"num_steps": 5}})
    with pytest.raises(ValidationError, match="min_lr_ratio"):
        TrainSection(lr_schedule="linear", min_lr_ratio=0.1)
    with pytest.raises(ValidationError, match="decaying lr_schedule"):
        TrainSection(lr_decay_steps=10)
    with pytest.raises(ValidationError, match="must exceed"):
        TrainSection(lr_schedule="cosine", lr_decay_steps=3, warmup_steps=3)


def test_resume_continues_the_schedule_where_it_stopped(tiny_model, backend_factory, tmp_path):
    lr = 1e-3
    train = {"lr": lr, "lr_schedule": "cosine", "warmup_steps": 1, "lr_decay_steps": 5}
    spec = make_spec(tiny_model, 1, train=train)
    f = lr_multiplier(TrainSection.model_validate({**train, "micro_batch_size": 2}), 5)
    batch = make_batch(3, seed=21)
    first = backend_factory(spec)
    seen = [first.train_step(batch)["train/lr"] for _ in range(2)]
    assert seen == pytest.approx([lr * f(0), lr * f(1)])
    first.save_checkpoint(str(tmp_path / "ckpt"))
    expected = [first.train_step(batch)["train/lr"] for _ in range(2)]
    first.shutdown()
    assert expected == pytest.approx([lr * f(2), lr * f(3)])

    second = backend_factory(spec)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    resumed = [second.train_step(batch)["train/lr"] for _ in range(2)]
    assert resumed == pytest.approx(expected, rel=1e-12)
