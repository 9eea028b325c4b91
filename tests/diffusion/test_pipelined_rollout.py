"""The pipelined diffusion rollout: microgroups streamed from the engine, unpacked in decode worker
processes, scored as they arrive.

Pipelining changes no number (same microgroup size: trajectories, log-probabilities and rewards
equal bit for bit); microgroups arrive and are scored in order, each before the engine has even
started the next (an event sequence forced by a gate, no sleeps); frames are unpacked in another
process, from shared memory, and a bad frame gets one clear error; the prompt is encoded once per
request. The engine runs in this process (uvicorn on a thread) so the tests can watch it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch

import miles_diffusion.engine.server as server_module
from miles.errors import EngineError
from miles.interfaces import RolloutContext
from miles.types import Group, Prompt, Sample, SamplingParams
from miles_diffusion.decode import close_decode_pools, decode_pool
from miles_diffusion.engine.client import DiffusionClient
from miles_diffusion.engine.server import DiffusionEngine, create_app
from miles_diffusion.group_rewards import BrightnessReward
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, save_pretrained
from miles_diffusion.rollout import DiffusionRollout
from miles_diffusion.sampler import SamplerConfig, sample_seeded
from miles_diffusion.wire import (
    STREAM_MEDIA_TYPE,
    FrameReader,
    TrajectoryBatch,
    WireError,
    frame_prefix,
    pack_error,
    pack_microgroup,
)

SAMPLER = SamplerConfig(num_steps=3, noise_level=0.7)
OPTIONS = {"num_steps": 3, "noise_level": 0.7, "seed": 5, "decode_workers": 2}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, DiffusionEngine]]:
    """A diffusion engine served on 127.0.0.1 from a thread of this process: (url, engine)."""
    import uvicorn

    model_dir = save_pretrained(build_tiny_model(TinyFlowModelConfig(), seed=0), tmp_path_factory.mktemp("m"))
    engine = DiffusionEngine(str(model_dir), max_batch_size=16)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the in-process engine did not start")
            threading.Event().wait(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        close_decode_pools()


def _rollout(url: str, options: dict[str, Any], reward: Any, prompts: int = 2, n: int = 6) -> list[Group]:
    async def go() -> list[Group]:
        client = DiffusionClient(url)
        ctx = RolloutContext(
            engines=[client],
            tokenizer=None,
            sampling=SamplingParams(),
            n_samples_per_prompt=n,
            reward=reward,
            options=options,
            step=3,
        )
        try:
            return await DiffusionRollout()(ctx, [Prompt(index=i, prompt=str(i % 4)) for i in range(prompts)])
        finally:
            await client.aclose()

    return asyncio.run(go())


def _samples(groups: list[Group]) -> list[Sample]:
    return [s for g in groups for s in g.samples]


def test_pipelined_equals_unpipelined_bit_for_bit(engine) -> None:
    url, _ = engine
    plain = _rollout(url, {**OPTIONS, "microgroup_size": 2}, BrightnessReward())
    piped = _rollout(url, {**OPTIONS, "microgroup_size": 2, "pipeline": True}, BrightnessReward())
    for a, b in zip(_samples(plain), _samples(piped), strict=True):
        assert a.status.value == b.status.value == "completed"
        assert a.payload.seed == b.payload.seed
        assert torch.equal(a.payload.latents, b.payload.latents)
        assert torch.equal(a.payload.log_probs, b.payload.log_probs)
        assert torch.equal(a.payload.timesteps, b.payload.timesteps)
        assert a.reward == b.reward and a.reward is not None  # scored per microgroup vs per group: equal
        assert a.payload.weight_version == b.payload.weight_version
    # What microgrouping itself changes: the batch size of the forward pass, so its rounding. The
    # noise is each trajectory's own (same starting noise), the rest agrees to a few ulp.
    whole = _rollout(url, dict(OPTIONS), BrightnessReward())
    for a, b in zip(_samples(whole), _samples(piped), strict=True):
        assert a.payload.seed == b.payload.seed
        assert torch.equal(a.payload.latents[0], b.payload.latents[0])
        torch.testing.assert_close(a.payload.latents, b.payload.latents, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.payload.log_probs, b.payload.log_probs, rtol=0, atol=1e-5)


class _Recorder:
    """An event log shared by the engine's sampling thread and the rollout's event loop."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.scored = [threading.Event() for _ in range(16)]
        self.lock = threading.Lock()

    def add(self, what: str, k: int) -> None:
        with self.lock:
            self.events.append((what, k))


class _RecordingReward(BrightnessReward):
    def __init__(self, recorder: _Recorder, size: int) -> None:
        super().__init__()
        self.recorder, self.size = recorder, size

    def __call__(self, samples: list[Sample]) -> list[float]:
        k = samples[0].group_index // self.size
        values = super().__call__(samples)
        self.recorder.add("scored", k)
        self.recorder.scored[k].set()
        return values


def _gated_sampler(monkeypatch, recorder: _Recorder, wait_s: float) -> None:
    """The engine samples microgroup k + 1 only once the client has scored microgroup k."""
    real: Callable[..., Any] = server_module.sample_seeded
    calls = iter(range(16))

    def gated(*args: Any, **kwargs: Any) -> Any:
        k = next(calls)
        if k > 0 and not recorder.scored[k - 1].wait(wait_s):
            recorder.add("gate_timeout", k)
            raise RuntimeError(f"microgroup {k - 1} was not scored while microgroup {k} waited")
        recorder.add("engine_start", k)
        out = real(*args, **kwargs)
        recorder.add("engine_done", k)
        return out

    monkeypatch.setattr(server_module, "sample_seeded", gated)


def test_microgroups_are_scored_in_order_each_before_the_engine_samples_the_next(engine, monkeypatch) -> None:
    url, eng = engine
    recorder = _Recorder()
    _gated_sampler(monkeypatch, recorder, wait_s=60.0)
    encodes: list[list[int]] = []
    real_encode = eng.model.encode_prompts
    monkeypatch.setattr(eng.model, "encode_prompts", lambda p: encodes.append(p.tolist()) or real_encode(p))
    options = {**OPTIONS, "microgroup_size": 2, "pipeline": True}
    [group] = _rollout(url, options, _RecordingReward(recorder, 2), prompts=1, n=6)
    assert [s.status.value for s in group.samples] == ["completed"] * 6
    # The engine cannot start microgroup k + 1 before the client scored k (the gate), and the run
    # finished: so each microgroup was received, unpacked and scored while the request was still open.
    expected = []
    for k in range(3):
        expected += [("engine_start", k), ("engine_done", k), ("scored", k)]
    assert recorder.events == expected
    assert encodes == [[0]]  # the prompt encoded once for the request's three microgroups


def test_unpipelined_cannot_pass_the_gate(engine, monkeypatch) -> None:
    """The control: without streaming nothing is scored before the whole answer, so the gate stops it."""
    url, _ = engine
    recorder = _Recorder()
    _gated_sampler(monkeypatch, recorder, wait_s=1.0)
    with pytest.raises(EngineError, match="HTTP 500"):
        _rollout(url, {**OPTIONS, "microgroup_size": 2}, _RecordingReward(recorder, 2), prompts=1, n=4)
    assert recorder.events == [("engine_start", 0), ("engine_done", 0), ("gate_timeout", 1)]


def test_frames_are_unpacked_in_a_worker_process_from_shared_memory(engine) -> None:
    url, _ = engine

    async def go() -> tuple[list[Any], TrajectoryBatch]:
        client = DiffusionClient(url)
        try:
            microgroups = [
                m async for m in client.stream_microgroups([0, 1, 2], [7, 8, 9], SAMPLER, 2, decode_pool(2))
            ]
            whole = await client.generate_trajectories([0, 1, 2], [7, 8, 9], SAMPLER, microgroup_size=2)
        finally:
            await client.aclose()
        return microgroups, whole

    microgroups, whole = asyncio.run(go())
    assert [(m.index, m.count, m.offset, m.batch.seeds) for m in microgroups] == [
        (0, 2, 0, [7, 8]),
        (1, 2, 2, [9]),
    ]
    assert all(m.worker_pid != os.getpid() for m in microgroups)
    assert all(m.batch.trajectory.latents.is_shared() for m in microgroups)  # views of the shared frame
    assert microgroups[0].finished_ns <= microgroups[1].started_ns  # sampled one after the other
    latents = torch.cat([m.batch.trajectory.latents for m in microgroups])
    assert torch.equal(latents, whole.trajectory.latents)


def _frame_bytes(index: int, count: int, offset: int, seeds: list[int]) -> bytes:
    model = build_tiny_model(TinyFlowModelConfig(image_size=8, block_out_channels=(8, 16)), seed=0)
    trajectory = sample_seeded(model.eval(), torch.tensor([0] * len(seeds)), seeds, SAMPLER)
    batch = TrajectoryBatch(trajectory, seeds, SAMPLER, 0)
    return pack_microgroup(batch, index=index, count=count, offset=offset, started_ns=1, finished_ns=2)


def _framed(*buffers: bytes) -> bytes:
    return b"".join(frame_prefix(b) + b for b in buffers)


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, content: bytes, size: int = 1000) -> None:
        self.content, self.size = content, size

    async def __aiter__(self):  # type: ignore[override]
        for i in range(0, len(self.content), self.size):
            yield self.content[i : i + self.size]


def _stream_from(content: bytes, seeds: list[int]) -> list[Any]:
    """The client's stream over a canned answer (no engine), in 1000-byte chunks."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Chunks(content), headers={"content-type": STREAM_MEDIA_TYPE})

    async def go() -> list[Any]:
        client = DiffusionClient("http://127.0.0.1:1")
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url=client.url)
        try:
            return [
                m
                async for m in client.stream_microgroups([0] * len(seeds), seeds, SAMPLER, 2, decode_pool(2))
            ]
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_bad_stream_gets_one_clear_error() -> None:
    first, second = _frame_bytes(0, 2, 0, [1, 2]), _frame_bytes(1, 2, 2, [3])
    assert len(_stream_from(_framed(first, second), [1, 2, 3])) == 2
    # A corrupt header (a tensor's byte range no longer fits): one WireError naming the microgroup.
    corrupt = second.replace(b'"latents":{"dtype":"F32"', b'"latents":{"dtype":"F64"', 1)
    with pytest.raises(WireError, match=r"microgroup 1 of 2: tensor 'latents': F64 .* does not fit"):
        _stream_from(_framed(first, corrupt), [1, 2, 3])
    with pytest.raises(WireError, match="safetensors header is not JSON"):
        _stream_from(_framed(first, second[:8] + b"#" + second[9:]), [1, 2, 3])
    with pytest.raises(WireError, match="the stream ended inside frame 1"):
        _stream_from(_framed(first, second)[:-5], [1, 2, 3])
    with pytest.raises(WireError, match="the stream ended after 2 of 3 trajectories"):
        _stream_from(_framed(first), [1, 2, 3])
    with pytest.raises(WireError, match="length 3 is outside"):
        _stream_from(_framed(first) + (3).to_bytes(8, "little") + b"abc", [1, 2, 3])
    with pytest.raises(WireError, match="out-of-order or foreign frame"):
        _stream_from(_framed(second, first), [1, 2, 3])
    with pytest.raises(EngineError, match="microgroup 1 of 2: generation failed: boom"):
        _stream_from(_framed(first, pack_error("generation failed: boom")), [1, 2, 3])


def test_the_frame_reader_cuts_frames_at_any_chunk_boundary() -> None:
    data = _framed(b"x" * 20, b"y" * 9, b"z" * 300)
    for size in (1, 7, 8, 9, 64, len(data)):
        reader = FrameReader(shared=False)
        frames = []
        for i in range(0, len(data), size):
            frames += reader.feed(data[i : i + size])
        reader.finish()
        assert [bytes(f.numpy()) for f in frames] == [b"x" * 20, b"y" * 9, b"z" * 300]
