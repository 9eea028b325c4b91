"""/weights_checker on a running embedded engine, and the digest it shares with trainers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engine.helpers import load_local, running_engine
from miles.engines.client import SyncEngineClient
from miles.engines.digest import DIGEST_ALGORITHM, tensor_digest
from miles.errors import EngineError

SKIP = ["model.norm.weight", "lm_head.weight"]  # lm_head.weight is tied: it names the embeddings


# ------------------------------------------------------------------ digest (fast)


def test_digest_is_of_the_raw_bytes() -> None:
    import xxhash

    t = torch.tensor([[1.5, -2.0], [0.0, 3.25]], dtype=torch.bfloat16)
    assert DIGEST_ALGORITHM == "xxh3_128"
    assert tensor_digest(t) == xxhash.xxh3_128_hexdigest(t.view(torch.int16).numpy().tobytes())
    # Bits, not values: -0.0 and 0.0 differ; a cast that rounds differs; layout does not matter.
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))
    assert tensor_digest(t) != tensor_digest(t.float())
    assert tensor_digest(t.t().contiguous().t()) == tensor_digest(t)
    assert tensor_digest(torch.tensor(2.0)) == tensor_digest(torch.tensor([2.0]))  # shape is reported apart
    assert len(tensor_digest(torch.zeros(0))) == 32


# ------------------------------------------------------------------ the endpoint (slow)


@pytest.fixture(scope="module")
def url(dense_dir: Path, engine_tmp: Path) -> Iterator[str]:
    with running_engine(dense_dir, engine_tmp / "logs-checker") as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[SyncEngineClient]:
    with SyncEngineClient(url) as c:
        yield c


@pytest.fixture
def restore(client: SyncEngineClient, dense_dir: Path) -> Iterator[None]:
    """Put the checkpoint's weights back after a test that randomised them."""
    yield
    client.update_weights_from_disk(str(dense_dir), 0)


@pytest.mark.slow
def test_checksum_reports_every_tensor_once(client: SyncEngineClient, dense_dir: Path) -> None:
    local = load_local(dense_dir)
    answer = client.weights_checker("checksum")
    # Every state-dict tensor, tied ones once under their first name (what named_parameters keeps).
    state = local.state_dict()
    assert "lm_head.weight" in state and "lm_head.weight" not in answer
    assert set(answer) == {n for n, _ in local.named_parameters()}
    for name, info in answer.items():
        assert info == {
            "dtype": "float32",
            "shape": list(state[name].shape),
            "digest": tensor_digest(state[name]),
        }, name
    partial = client.weights_checker("checksum", skip=SKIP)
    assert set(partial) == set(answer) - {"model.norm.weight", "model.embed_tokens.weight"}


@pytest.mark.slow
@pytest.mark.usefixtures("restore")
def test_reset_tensors_randomises_all_but_the_skipped(client: SyncEngineClient) -> None:
    before = client.weights_checker("checksum")
    version = client.weight_version()
    answer = client.weights_checker("reset_tensors", skip=SKIP, seed=3)
    assert answer["untouched"] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert set(answer["reset"]) == set(before) - set(answer["untouched"])
    after = client.weights_checker("checksum")
    for name in before:
        changed = after[name]["digest"] != before[name]["digest"]
        assert changed == (name in answer["reset"]), name
        assert after[name]["dtype"] == before[name]["dtype"] and after[name]["shape"] == before[name]["shape"]
    assert client.weight_version() == version  # the version is not touched
    # Seeded: the same seed gives the same values.
    client.weights_checker("reset_tensors", skip=SKIP, seed=3)
    assert client.weights_checker("checksum") == after
    client.weights_checker("reset_tensors", seed=4)
    assert all(v["digest"] != after[n]["digest"] for n, v in client.weights_checker("checksum").items())


@pytest.mark.slow
def test_bad_requests_are_refused(client: SyncEngineClient, url: str) -> None:
    before = client.weights_checker("checksum")
    with pytest.raises(
        EngineError, match=r"/weights_checker: .*skip names tensors this model does not have: "
    ):
        client.weights_checker("reset_tensors", skip=["model.layers.9.bogus"])
    with pytest.raises(EngineError, match="action 'compare' is not one of"):
        client.weights_checker("compare")
    for body in ({"action": "compare"}, {"action": "checksum", "skip": "model.norm.weight"}, {}):
        r = httpx.post(url + "/weights_checker", json=body, trust_env=False)
        assert r.status_code == 400 and r.json()["success"] is False, body
    assert client.weights_checker("checksum") == before
