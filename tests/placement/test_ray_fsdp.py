"""The FSDP backend with its ranks as Ray actors, against the same backend on local processes."""

from __future__ import annotations

import os
import signal

import pytest
from fsdp.helpers import make_batch, make_spec

from miles_fsdp.backend import RankFailedError
from miles_fsdp.ray_ranks import GROUP_NAME


def _on_ray(ray_address: str) -> dict:
    return {"launcher": "ray", "ray_address": ray_address, "bundle": {"CPU": 1}}


def _group_states() -> list[str]:
    from ray.util import placement_group_table

    return [g["state"] for g in placement_group_table().values() if g["name"] == GROUP_NAME]


def _steps(backend, batches) -> list[dict[str, float]]:
    return [backend.train_step(b) for b in batches]


@pytest.mark.parametrize(
    "num_ranks", [pytest.param(1, marks=pytest.mark.extended), pytest.param(2, marks=pytest.mark.slow)]
)
def test_ray_ranks_train_like_local_processes(tiny_model, backend_factory, ray_cluster, num_ranks):
    batches = [make_batch(5, seed=21, step=0), make_batch(5, seed=22, step=1)]
    local = backend_factory(make_spec(tiny_model, num_ranks))
    expected = _steps(local, batches)
    local.shutdown()

    on_ray = backend_factory(make_spec(tiny_model, num_ranks, placement=_on_ray(ray_cluster.address)))
    assert _group_states().count("CREATED") == 1
    assert set(on_ray.pids).isdisjoint({os.getpid()}) and len(on_ray.pids) == num_ranks
    got = _steps(on_ray, batches)
    for want, have in zip(expected, got, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/entropy", "loss/mean_logprob"):
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    # The offload pair travels through the actors like any command (a no-op on CPU).
    assert on_ray.offload() == {"offload/bytes": 0.0}
    assert on_ray.onload() == {"onload/bytes": 0.0}
    on_ray.shutdown()
    assert "CREATED" not in _group_states()  # the trainer's bundles were given back


def test_a_raising_rank_actor_reports_its_traceback_and_a_dead_one_breaks_the_backend(
    tiny_model, backend_factory, ray_cluster
):
    spec = make_spec(
        tiny_model,
        1,
        loss="fsdp.components:FailingLoss",
        loss_options={"rank": 0, "mode": "raise"},
        placement=_on_ray(ray_cluster.address),
    )
    backend = backend_factory(spec)
    with pytest.raises(RankFailedError) as info:
        backend.train_step(make_batch(3, seed=23))
    text = str(info.value)
    assert "rank 0" in text and "train_step" in text and "still usable" in text
    assert "Traceback" in text and "deliberate failure in the test loss" in text
    # Every rank answered, so the actor still serves: it fails the same way again.
    with pytest.raises(RankFailedError, match="deliberate failure"):
        backend.train_step(make_batch(3, seed=23))

    [pid] = backend.pids
    os.kill(pid, signal.SIGKILL)  # the actor's process dies under the backend
    with pytest.raises(RankFailedError, match=r"(?s)rank 0 failed during train_step.*actor died"):
        backend.train_step(make_batch(3, seed=23))
    with pytest.raises(RuntimeError, match="broken"):
        backend.train_step(make_batch(3, seed=23))
    assert "CREATED" not in _group_states()


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_is_stopped_after_the_grace_period(
    tiny_model, backend_factory, ray_cluster
):
    spec = make_spec(
        tiny_model,
        2,
        loss="fsdp.components:FailingLoss",
        loss_options={"rank": 1, "mode": "raise"},
        placement=_on_ray(ray_cluster.address),
    )
    backend = backend_factory(spec)
    with pytest.raises(RankFailedError) as info:
        backend.train_step(make_batch(4, seed=24))
    text = str(info.value)
    # Rank 0 waits in the backward's collective for rank 1, which raised: the group is stopped.
    assert "rank 1 failed during train_step" in text and "still usable" not in text
    assert "deliberate failure in the test loss" in text
    with pytest.raises(RuntimeError, match="broken"):
        backend.train_step(make_batch(4, seed=24))
    assert "CREATED" not in _group_states()


def test_cuda_on_ray_needs_a_gpu_per_rank_before_anything_starts(tiny_model):
    from miles.errors import ConfigError
    from miles_fsdp.backend import FSDPBackend

    placement = {"launcher": "ray", "ray_address": "127.0.0.1:1", "bundle": {"CPU": 2}}
    with pytest.raises(ConfigError, match="GPU"):
        FSDPBackend().setup(make_spec(tiny_model, 1, fsdp={"device": "cuda"}, placement=placement))
    with pytest.raises(ConfigError, match="launcher"):
        FSDPBackend().setup(make_spec(tiny_model, 1, placement={"launcher": "slurm"}))
