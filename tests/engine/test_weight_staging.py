"""Multi-bucket weight updates are transactions: nothing changes until the bucket carrying weight_version.

One embedded engine (a short ``update_timeout_s``) receives updates split into
buckets, over a gloo broadcast and as hand-off files; the engine's own checksums
(``/weights_checker``) show what the model holds after every bucket.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.helpers import load_local, make_tiny_qwen3, running_engine
from miles.engines.client import SyncEngineClient
from miles.engines.digest import tensor_digest
from miles.engines.launchers import free_port
from miles.engines.weight_group import WeightGroup, create_weight_group
from miles.errors import EngineError
from miles.types import SamplingParams

pytestmark = pytest.mark.slow  # one engine process for the module (~10 s to start on CPU)

TIMEOUT_S = 2.0
PROMPT = [7, 3, 9, 1]
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.8, seed=5)


@pytest.fixture(scope="module")
def handoff(engine_tmp: Path) -> Path:
    path = engine_tmp / "handoff-staging"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def client(dense_dir: Path, engine_tmp: Path, handoff: Path) -> Iterator[SyncEngineClient]:
    options = {"handoff_dir": str(handoff), "update_timeout_s": TIMEOUT_S}
    with running_engine(dense_dir, engine_tmp / "logs-staging", **options) as url, SyncEngineClient(url) as c:
        yield c


def new_weights(engine_tmp: Path, seed: int) -> dict[str, torch.Tensor]:
    """Another tiny model's parameters (tied embeddings once, as a trainer sends them)."""
    path = engine_tmp / f"dense-seed{seed}"
    if not path.exists():
        make_tiny_qwen3(path, seed=seed)
    return {n: p.detach().contiguous().clone() for n, p in load_local(path).named_parameters()}


def digests(client: SyncEngineClient) -> dict[str, str]:
    return {name: info["digest"] for name, info in client.weights_checker("checksum").items()}


def split3(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    names = list(tensors)
    cut = len(names) // 3
    parts = [names[:cut], names[cut : 2 * cut], names[2 * cut :]]
    return [{n: tensors[n] for n in part} for part in parts]


def staged(client: SyncEngineClient) -> dict | None:
    return client.get_server_info()["staged_update"]


def send_file(client: SyncEngineClient, handoff: Path, name: str, tensors: dict, **kwargs) -> dict:
    from safetensors.torch import save_file

    save_file(tensors, str(handoff / name))
    return client.update_weights_from_tensor([name], **kwargs)


@pytest.fixture
def group(client: SyncEngineClient) -> Iterator[WeightGroup]:
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, "stage", "gloo")
        g = create_weight_group("127.0.0.1", port, 0, 2, group_name="stage", backend="gloo", timeout_s=60)
        assert joined.result(timeout=60)["success"]
    try:
        yield g
    finally:
        g.destroy()
        client.destroy_weights_update_group("stage")


def broadcast_bucket(
    client: SyncEngineClient, group: WeightGroup, bucket: dict[str, torch.Tensor], **kwargs
) -> dict:
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            client.update_weights_from_distributed,
            list(bucket),
            [str(t.dtype) for t in bucket.values()],
            [list(t.shape) for t in bucket.values()],
            "stage",
            **kwargs,
        )
        for tensor in bucket.values():
            group.broadcast(tensor, src=0)
        return pending.result(timeout=60)


def test_broadcast_update_changes_nothing_until_its_last_bucket(
    client: SyncEngineClient, group: WeightGroup, engine_tmp: Path
) -> None:
    old, version = digests(client), client.weight_version()
    before = client.generate(PROMPT, PARAMS)
    new = new_weights(engine_tmp, 11)
    buckets = split3(new)
    for i, bucket in enumerate(buckets[:2]):
        answer = broadcast_bucket(client, group, bucket, bucket_index=i)
        assert answer["success"] and answer["committed"] is False
        assert f"Staged bucket {i}" in answer["message"]
        # Staged, not served: the model, the version and generation are all as before.
        assert digests(client) == old
        assert client.weight_version() == version
        assert client.generate(PROMPT, PARAMS).output_logprobs == before.output_logprobs
    assert staged(client)["buckets"] == 2
    assert staged(client)["tensors"] == len(buckets[0]) + len(buckets[1])

    answer = broadcast_bucket(client, group, buckets[2], bucket_index=2, weight_version=version + 1)
    assert answer["committed"] is True and f"Updated {len(new)} tensors from 3 bucket(s)" in answer["message"]
    assert digests(client) == {n: tensor_digest(t) for n, t in new.items()}
    assert client.weight_version() == version + 1
    assert staged(client) is None


def test_a_bad_bucket_discards_the_whole_staged_update(
    client: SyncEngineClient, group: WeightGroup, handoff: Path, engine_tmp: Path
) -> None:
    old, version = digests(client), client.weight_version()
    buckets = split3(new_weights(engine_tmp, 12))
    assert broadcast_bucket(client, group, buckets[0], bucket_index=0)["committed"] is False
    # An unknown name in the second bucket: still drained from the broadcast, then refused, naming it.
    bad = {**buckets[1], "model.layers.7.bogus.weight": torch.zeros(3)}
    with pytest.raises(
        EngineError, match=r"'model.layers.7.bogus.weight' is not a parameter.*earlier buckets"
    ):
        broadcast_bucket(client, group, bad, bucket_index=1)
    assert staged(client) is None
    # The rest of the refused update cannot commit on its own.
    with pytest.raises(
        EngineError, match="bucket_index 2 does not continue the staged update, which holds 0"
    ):
        send_file(client, handoff, "late.safetensors", buckets[2], weight_version=version + 1, bucket_index=2)
    # A tensor sent twice in one update is refused as well, dropping what was staged.
    assert send_file(client, handoff, "a.safetensors", buckets[0], bucket_index=0)["committed"] is False
    name = next(iter(buckets[0]))
    with pytest.raises(EngineError, match=rf"{name!r} was already sent in bucket 0 of this update"):
        send_file(client, handoff, "b.safetensors", {name: buckets[0][name]}, bucket_index=1)
    assert staged(client) is None
    assert digests(client) == old and client.weight_version() == version


def test_a_new_first_bucket_replaces_a_leftover_staged_update(
    client: SyncEngineClient, handoff: Path, engine_tmp: Path
) -> None:
    version = client.weight_version()
    stale = split3(new_weights(engine_tmp, 13))
    fresh = new_weights(engine_tmp, 14)
    send_file(client, handoff, "stale0.safetensors", stale[0], bucket_index=0)
    send_file(client, handoff, "stale1.safetensors", stale[1], bucket_index=1)
    # The sender restarted: its new update begins at bucket 0 and carries every tensor in one bucket.
    answer = send_file(
        client, handoff, "fresh.safetensors", fresh, bucket_index=0, weight_version=version + 1
    )
    assert (
        answer["committed"] is True and f"Updated {len(fresh)} tensors from 1 bucket(s)" in answer["message"]
    )
    assert digests(client) == {n: tensor_digest(t) for n, t in fresh.items()}


def test_a_stalled_update_times_out_and_its_rest_is_refused(
    client: SyncEngineClient, handoff: Path, engine_tmp: Path
) -> None:
    old, version = digests(client), client.weight_version()
    buckets = split3(new_weights(engine_tmp, 15))
    # No bucket_index (a plain SGLang caller): the engine relies on its own bookkeeping.
    assert send_file(client, handoff, "s0.safetensors", buckets[0])["committed"] is False
    assert send_file(client, handoff, "s1.safetensors", buckets[1])["committed"] is False
    deadline = time.monotonic() + TIMEOUT_S + 10
    while staged(client) is not None:  # the engine's timer drops it without any further call
        assert time.monotonic() < deadline, "the staged update was not dropped after update_timeout_s"
        time.sleep(0.2)
    # The last bucket comes too late: committing it alone would serve a partial update.
    with pytest.raises(EngineError, match=rf"no bucket for update_timeout_s = {TIMEOUT_S:g} s.*refused"):
        send_file(client, handoff, "s2.safetensors", buckets[2], weight_version=version + 1)
    assert digests(client) == old and client.weight_version() == version
    # Refused once: the sender's retry of the whole update goes through.
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        send_file(client, handoff, f"r{i}.safetensors", bucket, weight_version=version + 1 if last else None)
    merged = {n: t for bucket in buckets for n, t in bucket.items()}
    assert digests(client) == {n: tensor_digest(t) for n, t in merged.items()}
    assert client.weight_version() == version + 1
