"""The FSDP2 backend for real: rank processes on gloo, a tiny random Qwen3, a test loss by import path."""

from __future__ import annotations

import glob
import itertools
import os

import pytest
import torch

from fsdp.helpers import dumped_logprobs, hf_token_logprobs, make_batch, make_spec, weights
from miles_fsdp.backend import RankFailedError


def test_logprobs_equal_plain_hf_forward_with_temperature(tiny_model, backend_factory, tmp_path):
    batch = make_batch(5, seed=1)
    spec = make_spec(
        tiny_model,
        1,
        loss_options={"dump_dir": str(tmp_path)},
        temperature=0.7,
        fsdp={"start_method": "spawn"},
    )
    backend = backend_factory(spec)
    metrics = backend.train_step(batch)
    got = dumped_logprobs(str(tmp_path))
    want = hf_token_logprobs(tiny_model, batch, 0.7)
    assert sorted(got) == list(range(5))
    for i, ref in enumerate(want):
        torch.testing.assert_close(torch.tensor(got[i]), torch.tensor(ref), atol=1e-5, rtol=0)
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/entropy",
        "train/tokens_per_s",
        "loss/mean_logprob",
    ):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert metrics["train/num_loss_tokens"] == batch.num_loss_tokens


@pytest.mark.slow
def test_two_ranks_update_like_one_rank(tiny_model, backend_factory, tmp_path):
    """Global token-mean + summed gradients: DP over 2 ranks (with an idle pass) equals 1 rank exactly."""
    batches = [make_batch(5, seed=2, step=0), make_batch(5, seed=3, step=1)]
    results = {}
    for n in (1, 2):
        backend = backend_factory(make_spec(tiny_model, n, train={"micro_batch_size": 2, "grad_clip": 0.05}))
        metrics = [backend.train_step(b) for b in batches]
        backend.export_hf(str(tmp_path / f"r{n}"))
        backend.shutdown()
        results[n] = (metrics, weights(str(tmp_path / f"r{n}")))
    (m1, w1), (m2, w2) = results[1], results[2]
    for a, b in zip(m1, m2, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/entropy", "loss/mean_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert w1.keys() == w2.keys()
    moved = 0.0
    original = weights(tiny_model)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=2e-6, rtol=1e-5)
        moved = max(moved, float((w1[name] - original[name]).abs().max()))
    assert moved > 1e-4  # the step really changed the weights


def test_loss_falls_on_a_fixed_batch_with_positive_advantages(tiny_model, backend_factory):
    batch = make_batch(4, seed=4, positive=True)
    backend = backend_factory(make_spec(tiny_model, 1, train={"lr": 3e-3, "micro_batch_size": 4}))
    losses = [backend.train_step(batch)["train/loss"] for _ in range(5)]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses


def test_warmup_schedule_correction_and_rank_hooks(tiny_model, backend_factory, tmp_path):
    batch = make_batch(3, seed=5)
    spec = make_spec(
        tiny_model,
        1,
        correction="fsdp.components:HalfCorrection",
        loss_options={"dump_dir": str(tmp_path), "register_hooks": True},
        train={"lr": 1e-3, "warmup_steps": 4},
    )
    backend = backend_factory(spec)
    lrs = [backend.train_step(batch)["train/lr"] for _ in range(3)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4])
    # The correction said 0.5; the rank-side miles_correction_postprocess hook doubled it in place.
    d = torch.load(glob.glob(os.path.join(tmp_path, "*.pt"))[0])
    assert torch.all(d["correction_weights"] == 1.0)
    metrics = backend.train_step(batch)
    assert metrics["correction/weight_mean"] == 0.5 and metrics["correction/doubled"] == 1.0
    assert metrics["loss/hooked"] == 1.0  # the miles_loss_postprocess replacement was used


@pytest.mark.slow
def test_save_kill_load_resumes_identically(tiny_model, backend_factory, tmp_path):
    b0, b1 = make_batch(5, seed=6, step=0), make_batch(5, seed=7, step=1)
    spec = make_spec(tiny_model, 2, train={"warmup_steps": 3})
    first = backend_factory(spec)
    first.train_step(b0)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    expected = first.train_step(b1)
    first.export_hf(str(tmp_path / "uninterrupted"))
    for pid in first.pids:  # no clean shutdown: the run dies after its checkpoint
        os.kill(pid, 9)

    second = backend_factory(spec)
    second.load_checkpoint(str(tmp_path / "ckpt"))
    resumed = second.train_step(b1)
    second.export_hf(str(tmp_path / "resumed"))
    assert resumed["train/lr"] == expected["train/lr"]
    assert resumed["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-6)
    assert resumed["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-6)
    want, got = weights(str(tmp_path / "uninterrupted")), weights(str(tmp_path / "resumed"))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)


def test_export_hf_loads_back_and_matches_the_trainer(tiny_model, backend_factory, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    batch = make_batch(4, seed=8)
    backend = backend_factory(make_spec(tiny_model, 1, loss_options={"dump_dir": str(tmp_path / "dump")}))
    os.makedirs(tmp_path / "dump")
    backend.train_step(batch)
    backend.export_hf(str(tmp_path / "hf"))
    # The next step's loss inputs are computed with the exported weights.
    for f in glob.glob(str(tmp_path / "dump" / "*.pt")):
        os.remove(f)
    backend.train_step(batch)
    got = dumped_logprobs(str(tmp_path / "dump"))
    want = hf_token_logprobs(str(tmp_path / "hf"), batch, 0.8)
    for i, ref in enumerate(want):
        torch.testing.assert_close(torch.tensor(got[i]), torch.tensor(ref), atol=1e-5, rtol=0)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.dtype == torch.float32
    assert model.config.use_cache  # training-time settings do not leak into the export
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).convert_tokens_to_ids("t5") == 5


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "start_method"), [("raise", "spawn"), ("exit", "forkserver")])
def test_a_failing_rank_surfaces_with_its_traceback(tiny_model, backend_factory, mode, start_method):
    spec = make_spec(
        tiny_model,
        2,
        loss="fsdp.components:FailingLoss",
        loss_options={"rank": 1, "mode": mode},
        fsdp={"start_method": start_method},
    )
    backend = backend_factory(spec)
    with pytest.raises(RankFailedError) as info:
        backend.train_step(make_batch(4, seed=9))
    text = str(info.value)
    assert "rank 1" in text and "train_step" in text
    if mode == "raise":
        assert "deliberate failure in the test loss" in text and "Traceback" in text
    else:
        assert "exit code 3" in text
    with pytest.raises(RuntimeError, match="broken"):
        backend.train_step(make_batch(4, seed=9))


def test_bad_model_path_and_options_fail_before_spawning(tmp_path):
    from miles.errors import ConfigError, ModelError
    from miles_fsdp.backend import FSDPBackend

    with pytest.raises(ModelError, match=r"config\.json"):
        FSDPBackend().setup(make_spec(str(tmp_path), 1))
    with pytest.raises(ConfigError, match="num_ranks"):
        FSDPBackend().setup(make_spec(str(tmp_path), 1, fsdp={"num_ranks": 0}))


@pytest.mark.slow
def test_gradient_checkpointing_changes_nothing_but_memory(tiny_model, backend_factory):
    batch = make_batch(4, seed=10)
    results = []
    for ckpt in (False, True):
        backend = backend_factory(make_spec(tiny_model, 1, fsdp={"gradient_checkpointing": ckpt}))
        results.append(backend.train_step(batch))
        backend.shutdown()
    for key in ("train/loss", "train/grad_norm"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-6), key


def test_checkpoint_before_the_first_step_resumes_like_a_fresh_run(tiny_model, backend_factory, tmp_path):
    batch = make_batch(4, seed=11)
    spec = make_spec(tiny_model, 1, train={"grad_clip": None})
    fresh = backend_factory(spec)
    fresh.save_checkpoint(str(tmp_path / "ckpt0"))  # no optimizer state exists yet
    expected = fresh.train_step(batch)
    fresh.export_hf(str(tmp_path / "fresh"))
    resumed = backend_factory(spec)
    resumed.load_checkpoint(str(tmp_path / "ckpt0"))
    got = resumed.train_step(batch)
    resumed.export_hf(str(tmp_path / "resumed"))
    assert got["train/grad_norm"] == expected["train/grad_norm"] > 0
    want, have = weights(str(tmp_path / "fresh")), weights(str(tmp_path / "resumed"))
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=0, rtol=0)


def test_load_checkpoint_rejects_a_directory_that_is_not_one(tiny_model, backend_factory, tmp_path):
    backend = backend_factory(make_spec(tiny_model, 1))
    with pytest.raises(FileNotFoundError, match=r"trainer_state\.json"):
        backend.load_checkpoint(str(tmp_path))
    backend.train_step(make_batch(2))  # still usable


def test_unknown_components_and_transport_options_fail_in_the_driver(tiny_model):
    from miles.errors import ComponentError, ConfigError
    from miles_fsdp.backend import FSDPBackend

    with pytest.raises(ComponentError, match="no_such_loss"):
        FSDPBackend().setup(make_spec(tiny_model, 1, loss="no_such_loss"))
    spec = make_spec(tiny_model, 1, engine_urls=["http://127.0.0.1:9"], transport_options={"bucket_size": 3})
    # A wrong option is a configuration error since component options are validated models.
    with pytest.raises(ConfigError, match="bucket_size"):
        FSDPBackend().setup(spec)
