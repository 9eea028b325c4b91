"""Several optimizer steps per batch (``train.steps_per_rollout``): mini-batches and PPO's old log-probs."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from fsdp.helpers import make_batch, make_spec
from miles.train_rows import OLD_LOGPROBS, mini_batches, sub_batch
from miles_fsdp.backend import combine_step_metrics


def test_mini_batches_are_contiguous_near_equal_and_cover_the_batch():
    parts = mini_batches(10, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert [i for p in parts for i in p] == list(range(10))
    assert mini_batches(3, 8) == [range(0, 1), range(1, 2), range(2, 3)]  # never an empty one
    assert mini_batches(5, 1) == [range(0, 5)]


def test_sub_batch_keeps_advantages_and_returns_aligned():
    batch = make_batch(6, seed=3)
    batch.returns = [[float(i)] * len(s.response_ids) for i, s in enumerate(batch.samples)]
    part = sub_batch(batch, range(2, 5))
    assert [s.prompt.index for s in part.samples] == [2, 3, 4]
    assert part.advantages == batch.advantages[2:5] and part.returns == batch.returns[2:5]


def test_step_metrics_add_counts_and_times_and_weigh_the_rest_by_loss_tokens():
    out = combine_step_metrics(
        [
            (
                {
                    "train/loss": 1.0,
                    "train/lr": 0.1,
                    "train/num_tokens": 10.0,
                    "time/train_step/optimizer_s": 2.0,
                },
                1,
            ),
            (
                {
                    "train/loss": 4.0,
                    "train/lr": 0.2,
                    "train/num_tokens": 30.0,
                    "time/train_step/optimizer_s": 3.0,
                },
                3,
            ),
        ]
    )
    assert out["train/loss"] == pytest.approx(3.25)  # (1*1 + 4*3) / 4
    assert out["train/lr"] == 0.1 and out["train/num_tokens"] == 40.0
    assert out["time/train_step/optimizer_s"] == 5.0 and out["train/optimizer_steps"] == 2.0


def test_several_steps_equal_the_same_steps_taken_one_by_one(tiny_model, backend_factory, tmp_path):
    """A loss that ignores the old log-probs sees no difference between one call with two mini-batches
    and two calls of one step each: same split, same per-step normalisation, same updates."""
    batch = make_batch(6, seed=11)
    probe = make_batch(4, seed=12).samples
    dump = tmp_path / "dump"
    dump.mkdir()
    split = backend_factory(
        make_spec(tiny_model, 1, loss_options={"dump_dir": str(dump)}, train={"steps_per_rollout": 2})
    )
    metrics = split.train_step(batch)
    assert metrics["train/optimizer_steps"] == 2.0
    assert metrics["train/num_loss_tokens"] == batch.num_loss_tokens
    assert metrics["time/train_step/old_logprobs_s"] > 0
    after_split = split.score(probe, [OLD_LOGPROBS])[OLD_LOGPROBS]
    split.shutdown()

    # The old log-probs of both mini-batches are the policy before the first update: equal to the
    # current ones in the first mini-batch (up to batching), different in the second.
    dumps = sorted(glob.glob(os.path.join(dump, "*.pt")), key=lambda f: int(f.rsplit("-", 1)[1][:-3]))
    first = [torch.load(f) for f in dumps[:2]]  # micro_batch_size 2: three rows in two micro-batches
    second = [torch.load(f) for f in dumps[2:]]
    for d in first:
        torch.testing.assert_close(d["logprobs"] * d["loss_mask"], d["old_logprobs"] * d["loss_mask"])
    moved = max(float(((d["logprobs"] - d["old_logprobs"]) * d["loss_mask"]).abs().max()) for d in second)
    assert moved > 1e-4

    one_by_one = backend_factory(make_spec(tiny_model, 1))
    for indices in mini_batches(len(batch.samples), 2):
        one_by_one.train_step(sub_batch(batch, indices))
    after_steps = one_by_one.score(probe, [OLD_LOGPROBS])[OLD_LOGPROBS]
    for a, b in zip(after_split, after_steps, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


def test_ppo_clipping_acts_only_with_several_steps(tiny_model, backend_factory):
    batch = make_batch(8, seed=13)
    results = {}
    for steps in (1, 4):
        backend = backend_factory(
            make_spec(
                tiny_model,
                1,
                loss="ppo_clip",
                loss_options={"clip_low": 0.05, "clip_high": 0.05, "dual_clip": 1.1},
                train={"steps_per_rollout": steps, "lr": 3e-2, "grad_clip": None},
            )
        )
        results[steps] = backend.train_step(batch)
        backend.shutdown()
    one, four = results[1], results[4]
    # One step: the ratio is exactly 1, nothing is clipped, the KL to the old policy is 0.
    assert one["loss/clipfrac"] == 0.0 and one["loss/approx_kl"] == 0.0 and "train/optimizer_steps" not in one
    assert one["loss/dual_clipfrac"] == 0.0
    # Four: the later mini-batches are scored by a policy that has moved since the old log-probs.
    assert four["train/optimizer_steps"] == 4.0
    assert four["loss/approx_kl"] > 1e-4
    assert four["loss/clipfrac"] > 0.0
    assert four["loss/dual_clipfrac"] > 0.0  # negative-advantage tokens whose ratio passed 1.1


def test_more_steps_than_samples_per_step_is_refused_when_the_recipe_loads():
    from miles.config import load_recipe
    from miles.errors import ConfigError

    load_recipe("default", ["train.steps_per_rollout=4"])  # 8 prompts x 8 samples: fine
    with pytest.raises(ConfigError, match="steps_per_rollout"):
        load_recipe(
            "default",
            ["rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "train.steps_per_rollout=5"],
        )
