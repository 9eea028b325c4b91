"""Disk-delta and the weight-equality check against real embedded engines."""

from __future__ import annotations

import pytest
import torch

from miles.engines.client import SyncEngineClient
from miles.errors import EngineError
from transports.test_transports import assert_engines_serve, new_weights, reference_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def delta_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("weight-deltas"))


@pytest.fixture(scope="module")
def delta_engines(engine_model: str, delta_root: str, tmp_path_factory) -> list[str]:
    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec

    launcher = EmbeddedLauncher(startup_timeout_s=120)
    options = {"delta_root": delta_root, "torch_threads": 1, "max_batch_size": 4}
    try:
        yield launcher.launch(
            [EngineSpec(model_path=engine_model, options=dict(options)) for _ in range(2)],
            str(tmp_path_factory.mktemp("delta-engine-logs")),
        )
    finally:
        launcher.shutdown()


def _base(engine_model: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_model, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_deltas_reach_every_engine_checked_and_applied_once(engine_model, delta_root, delta_engines):
    from miles_transports.disk_delta import DiskDeltaTransport

    transport = DiskDeltaTransport(delta_dir=delta_root, check_equal=True)
    transport.connect(delta_engines, rank=0, world_size=1, device="cpu")
    try:
        transport.seed(iter(_base(engine_model).items()), 0)
        # v1: every weight differs (another initialisation); the weight check runs on this first update.
        weights = new_weights(engine_model, seed=11)
        stats = transport.send(iter(weights.items()), version=1)
        assert_engines_serve(delta_engines, reference_model(engine_model, weights), version=1)
        assert stats.metrics["delta_density"] > 0.9 and stats.buckets == 1

        # v2: one tensor changes in one element: a few bytes on disk, not a checkpoint.
        weights["model.norm.weight"][3] += 0.5
        stats = transport.send(iter(weights.items()), version=2)
        assert_engines_serve(delta_engines, reference_model(engine_model, weights), version=2)
        total = sum(t.numel() * 4 for t in weights.values())
        assert stats.metrics["delta_tensors_changed"] == 1.0
        # On disk: the index (a line per tensor, with digests) dominates for a model this small.
        assert stats.metrics["delta_changed_bytes"] <= 4 and stats.bytes_sent < total / 10

        # XOR must be applied exactly once: asking an engine for v2 again (it now holds v2) is refused,
        # and it keeps serving v2.
        with (
            SyncEngineClient(delta_engines[0], timeout=60) as client,
            pytest.raises(EngineError, match="delta applies to version 1, but this host holds version 2"),
        ):
            client.update_weights_from_disk_delta(2, weight_version="2")
        assert_engines_serve(delta_engines, reference_model(engine_model, weights), version=2)
    finally:
        transport.close()


def test_the_weight_check_catches_a_tensor_the_update_missed(engine_model, engines):
    from miles_transports.broadcast import BroadcastTransport
    from miles_transports.weight_check import WeightCheckError

    class LossyBroadcast(BroadcastTransport):
        """A transport with a bug: it loses one tensor between the trainer's stream and the engines."""

        def _deliver(self, prepared, version):
            return super()._deliver(((n, t) for n, t in prepared if n != "model.norm.weight"), version)

    weights = new_weights(engine_model, seed=5)
    transport = LossyBroadcast(bucket_mb=1, check_equal=True)
    transport.connect(engines[:1], rank=0, world_size=1, device="cpu")
    try:
        # The engine was randomised first, so the lost tensor cannot pass by holding its old value.
        with pytest.raises(WeightCheckError, match=r"1 tensor\(s\) on engine .* differ.*model\.norm\.weight"):
            transport.send(iter(weights.items()), version=1)
    finally:
        transport.close()
    # A correct transport passes the same check (and leaves the engine serving the new weights).
    transport = BroadcastTransport(
        bucket_mb=1, check_equal=True, check_skip=["model.layers.0.input_layernorm.weight"]
    )
    transport.connect(engines[:1], rank=0, world_size=1, device="cpu")
    try:
        transport.send(iter(weights.items()), version=2)
    finally:
        transport.close()
    skipped = "model.layers.0.input_layernorm.weight"
    served = {n: t for n, t in weights.items()}
    with SyncEngineClient(engines[0], timeout=60) as client:
        digests = {n: i["digest"] for n, i in client.weights_checker("checksum").items()}
    from miles.engines.digest import tensor_digest

    assert all(digests[n] == tensor_digest(t) for n, t in served.items() if n != skipped and n in digests)
