"""Weight updates on a running embedded engine: disk, gloo broadcast, hand-off files; refusals change nothing."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from engine.helpers import full_forward_logprobs, load_local, make_tiny_qwen3, running_engine
from miles.engines.client import SyncEngineClient
from miles.engines.launchers import free_port
from miles.engines.weight_group import create_weight_group
from miles.errors import EngineError
from miles.types import SamplingParams

# One engine process per module (~10 s to start on CPU).
pytestmark = pytest.mark.slow

PROMPT = [7, 3, 9, 1]
PARAMS = SamplingParams(max_new_tokens=8, temperature=0.8, seed=11)


@pytest.fixture(scope="module")
def handoff(engine_tmp: Path) -> Path:
    path = engine_tmp / "handoff"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def url(dense_dir: Path, engine_tmp: Path, handoff: Path):
    with running_engine(dense_dir, engine_tmp / "logs-weights", handoff_dir=str(handoff)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str):
    with SyncEngineClient(url) as c:
        yield c


def other_weights(engine_tmp: Path, seed: int):
    path = engine_tmp / f"dense-seed{seed}"
    if not path.exists():
        make_tiny_qwen3(path, seed=seed)
    return path, load_local(path)


def params_of(model) -> dict[str, torch.Tensor]:
    # named_parameters drops the tied alias (lm_head.weight shares the embedding).
    return {n: p.detach().contiguous().clone() for n, p in model.named_parameters()}


def assert_serves(client: SyncEngineClient, model) -> None:
    """The engine's logprobs equal a local forward of ``model``: its weights are being served."""
    out = client.generate(PROMPT, PARAMS)
    assert out.output_logprobs == pytest.approx(
        full_forward_logprobs(model, PROMPT, out.output_ids, 0.8), abs=1e-4
    )


def test_update_from_disk_changes_outputs_and_version(client: SyncEngineClient, engine_tmp: Path) -> None:
    before = client.generate(PROMPT, PARAMS)
    path, model = other_weights(engine_tmp, 1)
    result = client.update_weights_from_disk(str(path), 5)
    assert result["success"] is True
    assert client.weight_version() == 5
    after = client.generate(PROMPT, PARAMS)
    assert after.weight_version == 5
    assert after.output_logprobs != before.output_logprobs
    assert_serves(client, model)


def test_update_from_distributed_over_gloo(client: SyncEngineClient, url: str, engine_tmp: Path) -> None:
    _, model = other_weights(engine_tmp, 2)
    tensors = params_of(model)
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        # The engine's HTTP call returns once both ranks have joined; rank 0 (this process) joins meanwhile.
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, "g", "gloo")
        group = create_weight_group("127.0.0.1", port, 0, 2, group_name="g", backend="gloo", timeout_s=60)
        assert joined.result(timeout=60)["success"]
        try:
            names = list(tensors)
            dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
            shapes = [list(t.shape) for t in tensors.values()]
            pending = pool.submit(client.update_weights_from_distributed, names, dtypes, shapes, "g", 6)
            for name in names:
                group.broadcast(tensors[name], src=0)
            assert pending.result(timeout=60)["success"]
            assert client.weight_version() == 6
            assert_serves(client, model)

            # A bad shape is announced: the engine still drains the broadcast (no hang) and changes nothing.
            before = client.generate(PROMPT, PARAMS)
            bad_shapes = [list(s) for s in shapes]
            bad_shapes[-1] = [bad_shapes[-1][0] // 2]
            pending = pool.submit(client.update_weights_from_distributed, names, dtypes, bad_shapes, "g", 99)
            for shape in bad_shapes:
                group.broadcast(torch.zeros(shape), src=0)
            with pytest.raises(EngineError, match=rf"{names[-1]}.*shape \[16\].*model's is \[32\]"):
                pending.result(timeout=60)
            assert client.weight_version() == 6
            assert client.generate(PROMPT, PARAMS).output_logprobs == before.output_logprobs
        finally:
            group.destroy()
            client.destroy_weights_update_group("g")
    assert client.get_server_info()["groups"] == []
    with pytest.raises(EngineError, match="needs a CUDA engine"):
        client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "n", "nccl")
    with pytest.raises(EngineError, match="no weight group 'missing'"):
        client.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[128, 32]], "missing")


def test_handoff_file_updates_weights(client: SyncEngineClient, handoff: Path, engine_tmp: Path) -> None:
    from safetensors.torch import save_file

    _, model = other_weights(engine_tmp, 3)
    save_file(params_of(model), str(handoff / "v7.safetensors"))
    assert client.update_weights_from_tensor(["v7.safetensors"], 7)["success"]
    assert client.weight_version() == 7
    assert_serves(client, model)
    # A partial update (one tensor, other dtype: cast on the way in) is fine too.
    norm = torch.full((32,), 0.5, dtype=torch.bfloat16)
    save_file({"model.norm.weight": norm}, str(handoff / "norm.safetensors"))
    assert client.update_weights_from_tensor([str(handoff / "norm.safetensors")], 8)["success"]
    assert client.weight_version() == 8


def test_refused_updates_change_nothing(client: SyncEngineClient, handoff: Path, engine_tmp: Path) -> None:
    from safetensors.torch import save_file

    version = client.weight_version()
    before = client.generate(PROMPT, PARAMS)
    _, model = other_weights(engine_tmp, 4)
    tensors = params_of(model)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 16)  # wrong shape, after good ones
    save_file(tensors, str(handoff / "bad.safetensors"))
    with pytest.raises(EngineError, match=r"model.layers.1.mlp.up_proj.weight.*shape \[64, 16\].*\[64, 32\]"):
        client.update_weights_from_tensor(["bad.safetensors"], version + 1)
    save_file({"model.layers.9.bogus": torch.zeros(2)}, str(handoff / "unknown.safetensors"))
    with pytest.raises(EngineError, match=r"'model.layers.9.bogus' is not a parameter"):
        client.update_weights_from_tensor(["unknown.safetensors"], version + 1)
    bigger = engine_tmp / "bigger"
    from transformers import Qwen3Config, Qwen3ForCausalLM

    Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=128,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    ).save_pretrained(bigger)
    with pytest.raises(EngineError, match=r"shape \[128, 48\], the model's is \[128, 32\]"):
        client.update_weights_from_disk(str(bigger), version + 1)
    with pytest.raises(EngineError, match="is not a directory"):
        client.update_weights_from_disk(str(engine_tmp / "nowhere"), version + 1)
    assert client.weight_version() == version
    after = client.generate(PROMPT, PARAMS)
    assert after.output_ids == before.output_ids and after.output_logprobs == before.output_logprobs


def test_handoff_names_cannot_escape_the_directory(
    client: SyncEngineClient, url: str, handoff: Path, engine_tmp: Path
) -> None:
    from safetensors.torch import save_file

    outside = engine_tmp / "outside.safetensors"
    save_file({"model.norm.weight": torch.zeros(32)}, str(outside))
    os.symlink(outside, handoff / "link.safetensors")
    version = client.weight_version()
    for name in ("../outside.safetensors", str(outside), "link.safetensors", "sub/../../outside.safetensors"):
        with pytest.raises(EngineError, match="outside the hand-off directory"):
            client.update_weights_from_tensor([name], version + 1)
    r = httpx.post(
        url + "/update_weights_from_tensor",
        trust_env=False,
        json={"serialized_named_tensors": ["gASVAAAA"], "load_format": None},
    )
    assert r.status_code == 400 and "never unpickles" in r.json()["message"]
    assert client.weight_version() == version
