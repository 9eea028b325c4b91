"""The diffusion engine as a process of its own, over HTTP: what the core's loop relies on.

Trajectories come back as safetensors bytes whose log-probabilities the trainer re-scores exactly;
a full-weight update through the colocated transport lands and moves the version; a bad request
gets one clear error and changes nothing; the engine listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.engines.client import HANDOFF_LOAD_FORMAT, SyncEngineClient
from miles.errors import EngineError
from miles.interfaces import EngineSpec
from miles_diffusion.engine.client import DiffusionClient
from miles_diffusion.engine.launcher import DiffusionLauncher
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, load_pretrained, save_pretrained
from miles_diffusion.sampler import SamplerConfig, step_log_prob
from miles_diffusion.wire import MEDIA_TYPE, unpack
from miles_transports.colocated import ColocatedTransport

SAMPLER = SamplerConfig(num_steps=4, noise_level=0.7)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """One engine process on a tiny model: (url, model directory, hand-off directory)."""
    root = tmp_path_factory.mktemp("diffusion-engine")
    model_dir = save_pretrained(build_tiny_model(TinyFlowModelConfig(), seed=0), root / "model")
    handoff = root / "handoff"
    launcher = DiffusionLauncher()
    options = {"handoff_dir": str(handoff), "torch_threads": 1, "deterministic": True, "max_batch_size": 8}
    try:
        [url] = launcher.launch([EngineSpec(model_path=str(model_dir), options=options)], str(root / "logs"))
        yield url, model_dir, handoff
    finally:
        launcher.shutdown()


def _generate(url: str, prompts: list[int], seeds: list[int]):
    async def go():
        client = DiffusionClient(url)
        try:
            return await client.generate_trajectories(prompts, seeds, SAMPLER)
        finally:
            await client.aclose()

    return asyncio.run(go())


def _rescored(model, batch) -> torch.Tensor:
    with torch.no_grad():
        steps = [
            step_log_prob(model, batch.trajectory, i, batch.sampler.noise_level)[0]
            for i in range(SAMPLER.num_steps)
        ]
    return torch.stack(steps, dim=1)


def test_trajectories_come_back_as_raw_bytes_and_rescore_exactly_in_the_trainer(engine) -> None:
    url, model_dir, _ = engine
    body = {"prompts": [0, 1, 2, 3], "seeds": [11, 12, 13, 14], "num_steps": 4, "noise_level": 0.7}
    response = httpx.post(url + "/generate_trajectories", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"] == MEDIA_TYPE
    assert response.content[8:9] == b"{"  # a safetensors header: raw tensor bytes follow, no base64 text
    batch = unpack(response.content)
    assert batch.weight_version == 0 and batch.seeds == [11, 12, 13, 14]
    assert batch.trajectory.latents.shape == (4, 5, 3, 16, 16)
    assert batch.trajectory.log_probs.shape == (4, 4)
    # The trainer's model (loaded from the same directory) gives every step the same log-prob, bit for bit.
    trainer_model = load_pretrained(model_dir)
    assert torch.equal(_rescored(trainer_model, batch), batch.trajectory.log_probs)
    # A trajectory depends on its seed: the same request repeats exactly, another seed differs.
    again = _generate(url, [0, 1, 2, 3], [11, 12, 13, 14])
    assert torch.equal(again.trajectory.latents, batch.trajectory.latents)
    other = _generate(url, [0], [99])
    assert not torch.equal(other.trajectory.latents[0], batch.trajectory.latents[0])


def test_a_full_weight_update_lands_and_the_version_moves(engine) -> None:
    url, model_dir, handoff = engine
    new_model = build_tiny_model(TinyFlowModelConfig(), seed=7)  # other weights, same shape
    transport = ColocatedTransport(bucket_mb=0.05, handoff_dir=str(handoff))  # several buckets
    transport.connect([url], rank=0, world_size=1, device="cpu")
    try:
        stats = transport.send(iter(new_model.state_dict().items()), version=1)
    finally:
        transport.close()
    assert stats.buckets > 1 and stats.version == 1
    with SyncEngineClient(url) as client:
        assert client.weight_version() == 1
    batch = _generate(url, [2, 3], [5, 6])
    assert batch.weight_version == 1
    # What the engine now samples with is exactly the new weights: the new model re-scores it exactly.
    assert torch.equal(_rescored(new_model.eval(), batch), batch.trajectory.log_probs)
    assert not torch.equal(_rescored(load_pretrained(model_dir), batch), batch.trajectory.log_probs)
    # The fleet's catch-up path: a whole model directory, at a version.
    with SyncEngineClient(url) as client:
        client.update_weights_from_disk(str(model_dir), weight_version=2)
        assert client.weight_version() == 2
    assert list(handoff.iterdir()) == []  # the transport removed its files


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        (
            "/generate_trajectories",
            {"prompts": [0, 1], "seeds": [1], "num_steps": 4, "noise_level": 0.7},
            "1 seeds for 2 prompts",
        ),
        (
            "/generate_trajectories",
            {"prompts": [0, 9], "seeds": [1, 2], "num_steps": 4, "noise_level": 0.7},
            "prompt ids [9] are outside",
        ),
        (
            "/generate_trajectories",
            {"prompts": [0], "seeds": [1], "num_steps": 0, "noise_level": 0.7},
            "num_steps",
        ),
        (
            "/generate_trajectories",
            {"prompts": [0], "seeds": [1], "num_steps": 4, "noise_level": 0.7, "cfg": 3},
            "cfg",
        ),
        (
            "/generate_trajectories",
            {"prompts": list(range(4)) * 3, "seeds": list(range(12)), "num_steps": 4, "noise_level": 0.7},
            "at most 8",
        ),
        (
            "/generate_trajectories",
            {"prompts": [0], "seeds": [1], "num_steps": 4, "noise_level": 0.7, "microgroup_size": 0},
            "microgroup_size",
        ),
        ("/generate", {"input_ids": [1, 2, 3]}, "takes token ids"),
        (
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": ["../model.safetensors"],
                "load_format": HANDOFF_LOAD_FORMAT,
                "weight_version": "9",
            },
            "bare file name",
        ),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["x"], "load_format": "direct", "weight_version": "9"},
            "never unpickles",
        ),
        ("/update_weight_version", {"new_version": "soon"}, "not an integer"),
    ],
)
def test_a_bad_request_gets_one_clear_error_and_changes_nothing(engine, path, body, expected) -> None:
    url = engine[0]
    before = SyncEngineClient(url).weight_version()
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 400
    answer = response.json()
    assert answer["success"] is False and expected in answer["message"], answer
    assert SyncEngineClient(url).weight_version() == before


def test_a_partial_update_is_refused_whole(engine) -> None:
    url, _, handoff = engine
    from safetensors.torch import save_file

    state = build_tiny_model(TinyFlowModelConfig(), seed=3).state_dict()
    name = next(iter(state))
    save_file({name: state[name].contiguous()}, str(handoff / "part.safetensors"))
    before = SyncEngineClient(url).weight_version()
    with SyncEngineClient(url) as client, pytest.raises(EngineError, match="full weights"):
        client.update_weights_from_tensor(["part.safetensors"], weight_version=before + 1, bucket_index=0)
    (handoff / "part.safetensors").unlink()
    assert SyncEngineClient(url).weight_version() == before
    with pytest.raises(EngineError, match="prompt ids"):  # the client surfaces the engine's one message
        _generate(url, [5], [1])


def test_the_engine_listens_on_loopback_only(engine) -> None:
    url = engine[0]
    port = int(url.rsplit(":", 1)[1])
    assert url == f"http://127.0.0.1:{port}"
    # The kernel's table of listening TCP sockets: the engine's port is bound to 127.0.0.1 alone.
    listening = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            listening.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    assert listening == ["127.0.0.1"]
    assert not any(
        line.split()[1].endswith(f":{port:04X}")
        for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]
    )
