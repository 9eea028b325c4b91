"""Weight transports against real embedded engines: what the trainer sends is what the engines serve."""

from __future__ import annotations

import os

import pytest
import torch

from miles.errors import EngineError
from miles_transports.broadcast import BroadcastTransport
from miles_transports.bucket import MiB, iter_buckets
from miles_transports.colocated import ColocatedTransport

PROMPT = [5, 17, 33, 2, 90, 64]
SMALL_BUCKET_MB = 4096 / MiB  # 4 KiB: the 16 KiB embedding and the MLP matrices exceed it


def new_weights(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    """A differently initialised model of the same shape, as the trainer would stream it (tied once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reference_model(model_path: str, weights: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model


def engine_generation(url: str) -> tuple[list[int], list[float], int]:
    from miles.engines.client import SyncEngineClient
    from miles.types import SamplingParams

    with SyncEngineClient(url, timeout=60) as client:
        out = client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0))
        return out.output_ids, out.output_logprobs, client.weight_version()


def reference_logprobs(model, output_ids: list[int]) -> list[float]:
    with torch.no_grad():
        ids = torch.tensor([PROMPT + output_ids])
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    p = len(PROMPT)
    return [float(lp[p + j - 1, t]) for j, t in enumerate(output_ids)]


def assert_engines_serve(urls: list[str], model, version: int) -> None:
    for url in urls:
        ids, lps, served = engine_generation(url)
        assert served == version
        with torch.no_grad():
            greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[
                0, len(PROMPT) :
            ]
        assert ids == greedy.tolist()
        torch.testing.assert_close(
            torch.tensor(lps), torch.tensor(reference_logprobs(model, ids)), atol=1e-4, rtol=0
        )


# ------------------------------------------------------------------ bucketing


def test_buckets_respect_the_limit_and_oversized_tensors_travel_alone():
    tensors = [
        ("a", torch.zeros(10)),  # 40 B
        ("b", torch.zeros(10)),
        ("big", torch.zeros(100)),  # 400 B > limit
        ("c", torch.zeros(5)),
        ("d", torch.zeros(20)),
    ]
    buckets = list(iter_buckets(tensors, bucket_bytes=100))
    assert [b.names for b in buckets] == [["a", "b"], ["big"], ["c", "d"]]
    assert [b.last for b in buckets] == [False, False, True]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert buckets[0].nbytes == 80


def test_one_bucket_when_everything_fits():
    buckets = list(iter_buckets([("a", torch.zeros(3)), ("b", torch.zeros(2, dtype=torch.float16))], 1 << 20))
    assert len(buckets) == 1 and buckets[0].last and buckets[0].nbytes == 16


def test_non_zero_ranks_drain_the_stream_and_send_nothing():
    drained = []

    def stream():
        for i in range(3):
            drained.append(i)
            yield f"t{i}", torch.zeros(2)

    transport = BroadcastTransport(bucket_mb=1)
    transport.connect(["http://127.0.0.1:9"], rank=1, world_size=2, device="cpu")  # rank 1 never dials
    stats = transport.send(stream(), version=4)
    assert drained == [0, 1, 2]
    assert (stats.bytes_sent, stats.buckets, stats.version) == (0, 0, 4)
    transport.close()


def test_colocated_needs_a_handoff_dir():
    from miles.errors import ConfigError

    with pytest.raises(ConfigError, match="handoff_dir"):
        ColocatedTransport().connect(["http://127.0.0.1:9"], rank=0, world_size=1, device="cpu")


# ------------------------------------------------------------- real engines


@pytest.mark.slow
def test_colocated_update_reaches_every_engine(engines, engine_model, handoff_dir):
    weights = new_weights(engine_model, seed=1)
    model = reference_model(engine_model, weights)
    # The engines start from other weights: the check below can fail.
    ids, lps, _ = engine_generation(engines[0])
    assert not torch.allclose(torch.tensor(lps), torch.tensor(reference_logprobs(model, ids)), atol=1e-3)

    transport = ColocatedTransport(bucket_mb=SMALL_BUCKET_MB, handoff_dir=handoff_dir)
    transport.connect(engines, rank=0, world_size=1, device="cpu")
    try:
        stats = transport.send(iter(weights.items()), version=1)
        assert_engines_serve(engines, model, version=1)
        expected = list(iter_buckets(weights.items(), int(SMALL_BUCKET_MB * MiB)))
        assert stats.buckets == len(expected) > 3
        assert any(len(b.tensors) == 1 and b.nbytes > SMALL_BUCKET_MB * MiB for b in expected)
        assert stats.bytes_sent == sum(t.numel() * 4 for t in weights.values())
        assert os.listdir(handoff_dir) == []  # every hand-off file was removed

        # A second update moves the version on, and aliasing tensors (tied weights) are accepted.
        weights2 = new_weights(engine_model, seed=3)
        weights2["lm_head.weight"] = weights2["model.embed_tokens.weight"]
        transport.send(iter(weights2.items()), version=2)
        assert_engines_serve(engines, reference_model(engine_model, weights2), version=2)
    finally:
        transport.close()


@pytest.mark.slow
def test_colocated_refusal_names_the_engine_and_leaves_no_file(engines, engine_model, handoff_dir):
    transport = ColocatedTransport(handoff_dir=handoff_dir)
    transport.connect(engines, rank=0, world_size=1, device="cpu")
    try:
        with pytest.raises(EngineError, match=r"model\.norm\.weight.*shape"):
            transport.send(iter([("model.norm.weight", torch.zeros(7))]), version=99)
        assert os.listdir(handoff_dir) == []
        _, _, served = engine_generation(engines[0])
        assert served != 99
    finally:
        transport.close()


@pytest.mark.slow
@pytest.mark.parametrize("flatten", [False, True], ids=["per-tensor", "flat"])
def test_broadcast_update_reaches_every_engine(engines, engine_model, flatten):
    weights = new_weights(engine_model, seed=2)
    # Mixed dtypes make the flat layout's alignment matter (a bf16 tensor of odd size before fp32 ones).
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.bfloat16)
    model = reference_model(
        engine_model, {**weights, "model.norm.weight": weights["model.norm.weight"].float()}
    )
    transport = BroadcastTransport(bucket_mb=SMALL_BUCKET_MB, timeout_s=60, flatten=flatten)
    transport.connect(engines, rank=0, world_size=1, device="cpu")
    try:
        stats = transport.send(iter(weights.items()), version=7)
        assert_engines_serve(engines, model, version=7)
        assert stats.buckets == len(list(iter_buckets(weights.items(), int(SMALL_BUCKET_MB * MiB))))

        # An engine refuses a bucket that does not fit its model (after receiving it, so nobody hangs)...
        with pytest.raises(EngineError, match="not a parameter"):
            transport.send(iter([("model.no_such.weight", torch.zeros(4))]), version=8)
        # ...and the group still works for the next, correct update.
        weights3 = new_weights(engine_model, seed=4)
        transport.send(iter(weights3.items()), version=9)
        assert_engines_serve(engines, reference_model(engine_model, weights3), version=9)
    finally:
        transport.close()


@pytest.mark.slow
def test_broadcast_join_refused_by_engines_fails_fast(engines):
    import time

    first = BroadcastTransport(group_name="miles-test-fixed-group", timeout_s=60)
    first.connect(engines, rank=0, world_size=1, device="cpu")
    try:
        second = BroadcastTransport(group_name="miles-test-fixed-group", timeout_s=60)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="already exists"):
            second.connect(engines, rank=0, world_size=1, device="cpu")
        assert time.monotonic() - t0 < 20  # the engines' refusal ends the wait, not the 60 s timeout
    finally:
        first.close()


# ------------------------------------------------- the FSDP backend end to end


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["colocated", "broadcast"])
def test_fsdp_update_weights_reaches_engines(engines, engine_model, handoff_dir, tmp_path, transport):
    """Two FSDP ranks (tied embeddings) -> transport -> two engines: engines serve exactly the trainer's weights."""
    from fsdp.helpers import make_batch, make_spec
    from transformers import AutoModelForCausalLM

    from miles_fsdp.backend import FSDPBackend

    options = {"bucket_mb": SMALL_BUCKET_MB}
    if transport == "colocated":
        options["handoff_dir"] = handoff_dir
    spec = make_spec(
        engine_model,
        2,
        transport=transport,
        engine_urls=engines,
        transport_options=options,
        train={"lr": 1e-2},
    )
    backend = FSDPBackend()
    try:
        backend.setup(spec)
        for version in (21, 22):
            backend.train_step(make_batch(4, seed=version))
            stats = backend.update_weights(version)
            assert stats.version == version and stats.buckets > 3
            backend.export_hf(str(tmp_path / f"v{version}"))
            trained = AutoModelForCausalLM.from_pretrained(
                str(tmp_path / f"v{version}"), dtype=torch.float32
            ).eval()
            assert_engines_serve(engines, trained, version=version)
    finally:
        backend.shutdown()


@pytest.mark.slow
def test_a_refused_update_fails_the_call_but_leaves_the_trainer_usable(engines, tmp_path):
    """Every rank drains the stream even when the engines refuse it, so no rank is left in a collective."""
    from fsdp.helpers import build_tiny_qwen3, make_batch, make_spec

    from miles_fsdp.backend import FSDPBackend, RankFailedError

    wider = str(build_tiny_qwen3(tmp_path / "wider", intermediate_size=48))  # the engines' MLP is 64 wide
    spec = make_spec(
        wider, 2, transport="broadcast", engine_urls=engines, transport_options={"bucket_mb": 0.01}
    )
    backend = FSDPBackend()
    try:
        backend.setup(spec)
        with pytest.raises(RankFailedError, match=r"still usable(.|\n)*mlp.*shape"):
            backend.update_weights(50)
        assert backend.train_step(make_batch(2))["train/grad_norm"] > 0  # the ranks are still in step
        _, _, served = engine_generation(engines[0])
        assert served != 50
    finally:
        backend.shutdown()


def test_flat_layout_aligns_every_tensor():
    from miles.engines.weight_group import FLAT_ALIGN, flat_layout

    offsets, total = flat_layout([6, 0, 300, 4])
    # 6 bytes at 0; the empty tensor and the next start at the next 256-byte boundary; and so on.
    assert offsets == [0, 256, 256, 768] and total == 772
    assert all(o % FLAT_ALIGN == 0 for o in offsets)
