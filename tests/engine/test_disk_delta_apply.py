"""/update_weights_from_disk_delta on a running embedded engine: verified deltas apply, bad ones change nothing.

The trainer side is played by a real :class:`miles_transports.weight_delta.DeltaWriter` seeded
with the checkpoint the engine loaded (read with safetensors) and publishing perturbed
copies into the engine's ``--delta-root``. What the engine holds is read back with
its own checksums (``/weights_checker``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engine.helpers import running_engine
from miles.engines.client import SyncEngineClient
from miles.engines.digest import tensor_digest
from miles.errors import EngineError

pytestmark = pytest.mark.slow  # one engine process for the module (~10 s to start on CPU)

_versions = itertools.count(1)


@pytest.fixture(scope="module")
def delta_root(engine_tmp: Path) -> Path:
    path = engine_tmp / "deltas"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def url(dense_dir: Path, engine_tmp: Path, delta_root: Path) -> Iterator[str]:
    with running_engine(dense_dir, engine_tmp / "logs-delta", delta_root=str(delta_root)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[SyncEngineClient]:
    with SyncEngineClient(url) as c:
        yield c


class Held:
    """What the engine should hold: its tensors and version, moved forward by every applied delta."""

    def __init__(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.state, self.version = state, version

    def writer(self, root: Path, encoding: str = "xor"):
        from miles_transports.weight_delta import DeltaWriter

        w = DeltaWriter(str(root), encoding=encoding)
        w.seed(self.state.items(), self.version)
        return w


@pytest.fixture(scope="module")
def held(dense_dir: Path, client: SyncEngineClient) -> Held:
    from safetensors.torch import load_file

    state = load_file(str(dense_dir / "model.safetensors"))
    assert digests(client) == expected(state)  # the engine holds exactly the checkpoint
    return Held(state, client.weight_version())


def digests(client: SyncEngineClient) -> dict[str, str]:
    return {name: info["digest"] for name, info in client.weights_checker("checksum").items()}


def expected(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(t) for name, t in state.items()}


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A small step on every other tensor (the rest unchanged), like one optimizer step."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, t) in enumerate(state.items()):
        step = 1e-3 * torch.randn(t.shape, generator=gen, dtype=t.dtype) if i % 2 == 0 else 0
        out[name] = (t + step).contiguous()
    return out


def assert_unchanged(client: SyncEngineClient, held: Held) -> None:
    assert client.weight_version() == held.version
    assert digests(client) == expected(held.state)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_delta_round_trip(client: SyncEngineClient, held: Held, delta_root: Path, encoding: str) -> None:
    writer = held.writer(delta_root, encoding)
    new = perturbed(held.state, seed=next(_versions))
    version = held.version + next(_versions)
    stats = writer.publish(new.items(), version)
    assert 0 < stats.tensors_changed < stats.tensors

    answer = client.update_weights_from_disk_delta(version)
    assert f"{stats.tensors_changed} tensors changed" in answer["message"]
    assert client.weight_version() == version  # default: str(version)
    assert digests(client) == expected(new)
    held.state, held.version = new, version


def test_weight_version_can_be_named(client: SyncEngineClient, held: Held, delta_root: Path) -> None:
    writer = held.writer(delta_root)
    new = perturbed(held.state, seed=next(_versions))
    version = held.version + next(_versions)
    writer.publish(new.items(), version)
    client.update_weights_from_disk_delta(version, weight_version=version + 1000)
    assert client.weight_version() == version + 1000
    # Put the version back on the delta numbering for the other tests (weights are unaffected).
    client.update_weight_version(version)
    assert digests(client) == expected(new)
    held.state, held.version = new, version


def test_a_delta_is_applied_only_on_its_base(client: SyncEngineClient, held: Held, delta_root: Path) -> None:
    writer = held.writer(delta_root)
    new = perturbed(held.state, seed=next(_versions))
    version = held.version + next(_versions)
    writer.publish(new.items(), version)
    client.update_weights_from_disk_delta(version)
    base = held.version
    held.state, held.version = new, version
    # Again: the engine is no longer on the delta's base (an xor delta applied twice would revert it).
    with pytest.raises(
        EngineError, match=rf"delta applies to version {base}, but this host holds version {version}"
    ):
        client.update_weights_from_disk_delta(version)
    assert_unchanged(client, held)

    # Right version number, wrong bytes: a writer whose snapshot is not what the engine holds.
    liar = Held(perturbed(held.state, seed=999), held.version).writer(delta_root)
    wrong = held.version + next(_versions)
    liar.publish(perturbed(held.state, seed=next(_versions)).items(), wrong)
    with pytest.raises(EngineError, match="not the base the delta was computed against"):
        client.update_weights_from_disk_delta(wrong)
    assert_unchanged(client, held)

    # A delta in another dtype than the engine serves is refused, not converted.
    bf16 = Held({n: t.to(torch.bfloat16) for n, t in held.state.items()}, held.version).writer(delta_root)
    other = held.version + next(_versions)
    bf16.publish(perturbed({n: t.to(torch.bfloat16) for n, t in held.state.items()}, seed=5).items(), other)
    with pytest.raises(EngineError, match=r"index has torch\.bfloat16.*this host holds torch\.float32"):
        client.update_weights_from_disk_delta(other)
    assert_unchanged(client, held)


def test_corrupt_or_incomplete_deltas_change_nothing(
    client: SyncEngineClient, held: Held, delta_root: Path
) -> None:
    writer = held.writer(delta_root)
    version = held.version + next(_versions)
    writer.publish(perturbed(held.state, seed=next(_versions)).items(), version)
    vdir = delta_root / f"v{version:06d}"
    [data] = sorted(vdir.glob("data-*.bin"))
    original = data.read_bytes()

    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF
    data.write_bytes(bytes(flipped))
    with pytest.raises(EngineError, match=rf"weights not updated: delta v{version:06d}.*{data.name}"):
        client.update_weights_from_disk_delta(version)
    assert_unchanged(client, held)

    data.write_bytes(original[:-10])
    with pytest.raises(EngineError, match="truncated"):
        client.update_weights_from_disk_delta(version)
    assert_unchanged(client, held)

    data.write_bytes(original)
    os.remove(vdir / "index.json")
    with pytest.raises(EngineError, match=r"no index\.json"):
        client.update_weights_from_disk_delta(version)
    with pytest.raises(EngineError, match=f"version {version + 1} was not published"):
        client.update_weights_from_disk_delta(version + 1)
    assert_unchanged(client, held)


def test_requests_cannot_name_a_path(client: SyncEngineClient, url: str, held: Held) -> None:
    for body in (
        {"version": "../../etc"},
        {"version": "1"},
        {"version": 1.5},
        {"version": -1},
        {"version": 1, "path": "/etc"},
        {"version": 1, "delta_root": "/tmp"},
        {},
    ):
        r = httpx.post(url + "/update_weights_from_disk_delta", json=body, trust_env=False)
        assert r.status_code == 400, body
        assert r.json()["success"] is False
    with pytest.raises(EngineError, match="version must be an integer >= 0"):
        client.update_weights_from_disk_delta("../1")  # type: ignore[arg-type]
    assert_unchanged(client, held)


def test_an_engine_without_delta_root_refuses(dense_dir: Path) -> None:
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions
    from miles.engines.embedded.server import create_app

    engine = EmbeddedEngine(EngineOptions(model_path=str(dense_dir), dtype="float32"))
    engine.start()

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            return await http.post("/update_weights_from_disk_delta", json={"version": 1})

    try:
        r = asyncio.run(post())
    finally:
        engine.stop()
    assert r.status_code == 400
    assert "started without --delta-root" in r.json()["message"]
