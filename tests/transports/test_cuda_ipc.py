"""The CUDA-IPC transport (one GPU shared by trainer and engine).

On the CPU: the flat-buffer layout round-trips every dtype, the engine's route refuses a handle it
cannot open and leaves the model as it was, and a recipe that cannot run (CPU devices, a
disaggregated placement with engine.release_memory) is refused before anything starts. On CUDA
(marked gpu, run by scripts/gpu-tests.sh): an FSDP rank and an embedded engine on the same GPU,
the weight-equality check on, the engine serving exactly the trained model afterwards.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from miles.errors import ConfigError
from miles_transports.cuda_ipc import ALIGN, IpcBucket, IpcHandle, IpcTensor, plan_layout, views

RECIPE = str(Path(__file__).parent.parent / "data" / "recipes" / "tiny.yaml")


def _fill(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[IpcTensor]]:
    layout = plan_layout(named)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for spec, (_, t) in zip(layout.tensors, named, strict=True):
        n = t.numel() * t.element_size()
        buffer[spec.offset : spec.offset + n].view(t.dtype).view(t.shape).copy_(t)
    return buffer, layout.tensors


def test_flat_layout_round_trips_mixed_dtypes_at_aligned_offsets():
    g = torch.Generator().manual_seed(0)
    named = [
        ("a.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("b.bias", torch.randn(7, generator=g)),
        ("c.count", torch.arange(5, dtype=torch.int64)),
        ("d.half", torch.randn(2, 2, 3, generator=g).to(torch.float16)),
    ]
    buffer, specs = _fill(named)
    assert all(s.offset % ALIGN == 0 for s in specs)
    assert [s.offset for s in specs] == sorted({s.offset for s in specs})  # no overlap, in order
    got = views(buffer, specs)
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    assert got["a.weight"].data_ptr() == buffer.data_ptr()  # views, not copies


def test_views_refuse_bad_specs():
    buffer, _ = _fill([("w", torch.ones(4))])
    with pytest.raises(ValueError, match="not a torch dtype"):
        views(buffer, [IpcTensor(name="w", dtype="floatish", shape=[4], offset=0)])
    with pytest.raises(ValueError, match="does not lie aligned inside"):
        views(buffer, [IpcTensor(name="w", dtype="float32", shape=[4], offset=8)])
    with pytest.raises(ValueError, match="does not lie aligned inside"):
        views(buffer, [IpcTensor(name="w", dtype="float32", shape=[1000], offset=0)])


def _fake_bucket(name: str, shape: list[int]) -> IpcBucket:
    handle = IpcHandle(
        device_uuid="GPU-00000000-0000-0000-0000-000000000000",
        handle="AAAA",
        size_bytes=1024,
        offset_bytes=0,
        ref_counter_handle="AAAA",
        ref_counter_offset=0,
        event_handle="",
        event_sync_required=False,
    )
    return IpcBucket(
        buffer=handle,
        tensors=[IpcTensor(name=name, dtype="float32", shape=shape, offset=0)],
        weight_version="7",
    )


def test_a_cpu_engine_refuses_a_cuda_ipc_bucket_and_keeps_its_weights(tmp_path):
    from engine.helpers import make_tiny_qwen3

    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions
    from miles.engines.embedded.receivers import installed_receivers
    from miles.engines.embedded.server import create_app

    model_dir = make_tiny_qwen3(tmp_path / "m")
    engine = EmbeddedEngine(EngineOptions(model_path=str(model_dir), dtype="float32"))
    engine.start()
    name, target = next(iter(engine.weights.targets.items()))
    before = target.detach().clone()

    async def post() -> httpx.Response:
        app = create_app(engine, installed_receivers())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            body = _fake_bucket(name, list(target.shape)).model_dump(mode="json")
            return await http.post("/update_weights_from_cuda_ipc", json=body)

    try:
        r = asyncio.run(post())
        version = engine.weight_version
    finally:
        engine.stop()
    assert r.status_code == 400
    assert "can only be opened by a CUDA engine" in r.json()["message"]
    assert torch.equal(engine.weights.targets[name], before)
    assert version != "7"


def _config(*overrides: str):
    from miles.config.loader import load_recipe

    return load_recipe(RECIPE, list(overrides))


def test_a_cpu_recipe_with_the_cuda_ipc_transport_is_refused_before_it_starts():
    from miles.capabilities import check_needs

    config = _config("transport=cuda-ipc", "fsdp.device=cpu", "engine.device=cpu")
    with pytest.raises(
        ConfigError, match=r"cuda-ipc.*needs the trainer and the engines on cuda devices"
    ) as err:
        check_needs(config)
    assert "engine.device is 'cpu'" in str(err.value) and "fsdp.device is 'cpu'" in str(err.value)


def test_release_memory_needs_shared_devices():
    from miles.capabilities import check_needs

    config = _config("transport=broadcast", "engine.release_memory=true")
    with pytest.raises(ConfigError, match=r"engine\.release_memory frees the engines' KV cache"):
        check_needs(config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_hands_weights_to_an_engine_on_the_same_gpu(engine_model, tmp_path):
    from transports.gpu_round_trip import train_and_update_engine

    # Two versions: the second update reuses what the first set up on the engine.
    train_and_update_engine(
        engine_model, tmp_path, engine_device="cuda", transport="cuda-ipc", transport_options={}, versions=2
    )
