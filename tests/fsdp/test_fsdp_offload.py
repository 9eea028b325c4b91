"""Offload / onload of the FSDP trainer on CPU: the commands travel, training is unchanged, misuse is refused."""

from __future__ import annotations

import pytest

from fsdp.helpers import make_batch, make_spec

KEYS = ("train/loss", "train/grad_norm", "train/entropy", "loss/mean_logprob")


def test_offload_round_trip_keeps_training_results_identical(tiny_model, backend_factory):
    batches = [make_batch(5, seed=31 + i, step=i) for i in range(3)]
    plain = backend_factory(make_spec(tiny_model, 1))
    want = [plain.train_step(b) for b in batches]
    plain.shutdown()

    backend = backend_factory(make_spec(tiny_model, 1))
    got = [backend.train_step(batches[0])]
    assert backend.offload() == {"offload/bytes": 0.0}  # nothing lives on a GPU
    assert backend.offload() == {"offload/bytes": 0.0}  # twice is harmless
    with pytest.raises(RuntimeError, match=r"offloaded to the CPU; call onload\(\) first"):
        backend.train_step(batches[1])
    assert backend.onload() == {"onload/bytes": 0.0}
    got += [backend.train_step(b) for b in batches[1:]]
    for a, b in zip(want, got, strict=True):
        for key in KEYS:
            assert a[key] == b[key], key
