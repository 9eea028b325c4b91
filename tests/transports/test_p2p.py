"""Peer-to-peer weight updates over Mooncake (tcp) between real processes: trainer side -> embedded engines.

Every engine tensor is compared with what the trainer sent through the engine's
``/weights_checker`` digests (xxh3 of the raw bytes: bit-exact). Tests that move
bytes need Mooncake's ``mooncake`` module (``pip install 'miles-transports[p2p]'``)
and are skipped without it; the error paths for a missing Mooncake run everywhere.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

from miles.engines.client import EngineCall, SyncEngineClient
from miles.engines.digest import tensor_digest
from miles.errors import ConfigError, EngineError
from miles_transports.bucket import MiB, iter_buckets
from transports.p2p_support import needs_mooncake

P2P = "miles_transports.p2p.transport:P2PTransport"
SMALL_BUCKET_MB = 4096 / MiB  # 4 KiB: many buckets; the 16 KiB embedding is larger than a bucket


def new_weights(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    """A differently initialised model of the same shape, as a trainer streams it (tied weights once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def call(url: str, path: str, body: dict | None = None, timeout: float = 30.0):
    with SyncEngineClient(url, timeout=timeout) as client:
        return client.call(EngineCall("POST", path, body if body is not None else {}))


def engine_version(url: str) -> int:
    with SyncEngineClient(url, timeout=30) as client:
        return client.weight_version()


def assert_engine_holds(url: str, weights: dict[str, torch.Tensor]) -> None:
    """Every tensor of the engine equals the sent one, bit for bit (in the dtype the engine holds).

    ``weights`` may also hold aliases the engine reports once (a tied ``lm_head.weight``).
    """
    held = call(url, "/weights_checker", {"action": "checksum"})
    assert set(held) <= set(weights), f"engine tensors nobody sent: {sorted(set(held) - set(weights))}"
    for name in held:
        sent = weights[name]
        dtype = getattr(torch, held[name]["dtype"])
        assert held[name]["shape"] == list(sent.shape), name
        assert held[name]["digest"] == tensor_digest(sent.to(dtype)), f"{url}: {name} differs"


@pytest.fixture(scope="module")
def p2p_engines(engine_model: str, tmp_path_factory: pytest.TempPathFactory):
    """Two embedded engines (real processes): ``(urls, pids)``."""
    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec

    launcher = EmbeddedLauncher(startup_timeout_s=120)
    options = {"torch_threads": 1, "max_batch_size": 4, "dtype": "float32"}
    try:
        urls = launcher.launch(
            [EngineSpec(model_path=engine_model, options=dict(options)) for _ in range(2)],
            str(tmp_path_factory.mktemp("p2p-engine-logs")),
        )
        yield urls, launcher.pids
    finally:
        launcher.shutdown()


# ------------------------------------------------------------- without Mooncake


@pytest.fixture
def no_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import mooncake.engine`` fail, as in an environment without the extra."""
    for name in list(sys.modules):
        if name == "mooncake" or name.startswith("mooncake."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)


def test_without_mooncake_the_engine_refuses_init_naming_the_extra(no_mooncake):
    from miles.engines.embedded.weights import WeightUpdater
    from miles_transports.p2p.receiver import P2PError, P2PService

    model = torch.nn.Linear(2, 2)
    weights = WeightUpdater(
        model, step_lock=threading.Lock(), get_version=lambda: "0", set_version=lambda v: None
    )
    service = P2PService(weights, torch.device("cpu"))
    with pytest.raises(P2PError, match=r"pip install 'miles-transports\[p2p\]'"):
        service.init(bucket_bytes=1024, protocol="tcp", hostname="127.0.0.1")
    assert service.receiver is None


def test_without_mooncake_the_transport_refuses_to_connect_naming_the_extra(no_mooncake):
    from miles_transports.p2p import P2PTransport

    transport = P2PTransport(bucket_mb=1)
    with pytest.raises(ConfigError, match=r"miles-transports\[p2p\]"):
        transport.connect(["http://127.0.0.1:9"], rank=0, world_size=1, device="cpu")
    # A rank with no engine to feed never needs Mooncake.
    idle = P2PTransport(bucket_mb=1)
    idle.connect(["http://127.0.0.1:9"], rank=1, world_size=2, device="cpu")
    stats = idle.send(iter([("w", torch.zeros(3))]), version=1)
    assert (stats.bytes_sent, stats.buckets) == (0, 0)
    idle.close()


def test_bad_options_are_refused():
    from miles_transports.p2p import P2PTransport

    with pytest.raises(ConfigError, match="protocol must be one of"):
        P2PTransport(protocol="carrier-pigeon")
    with pytest.raises(ConfigError, match="timeout_s"):
        P2PTransport(timeout_s=0)


def test_layout_is_checked_against_the_buffer():
    from miles_transports.p2p.receiver import P2PError, parse_layout

    ok = parse_layout(["a", "b"], ["float32", "torch.bfloat16"], [[2, 3], [4]], [0, 64], buffer_len=72)
    assert [(s.name, s.nbytes, s.offset) for s in ok] == [("a", 24, 0), ("b", 8, 64)]
    with pytest.raises(P2PError, match="one of each per tensor"):
        parse_layout(["a"], ["float32"], [[1]], [], buffer_len=8)
    with pytest.raises(P2PError, match="outside the receive buffer of 16 bytes"):
        parse_layout(["a"], ["float32"], [[5]], [0], buffer_len=16)
    with pytest.raises(P2PError, match="not a multiple of its item size 4"):
        parse_layout(["a"], ["float32"], [[1]], [2], buffer_len=16)
    with pytest.raises(P2PError, match="'a' and 'b' overlap"):
        parse_layout(["a", "b"], ["float32", "float32"], [[2], [2]], [0, 4], buffer_len=16)
    with pytest.raises(P2PError, match="negative"):
        parse_layout(["a"], ["float32"], [[-1]], [0], buffer_len=16)
    with pytest.raises(P2PError, match="unknown dtype"):
        parse_layout(["a"], ["float33"], [[1]], [0], buffer_len=16)


# ---------------------------------------------------------------- real transfers


@needs_mooncake
@pytest.mark.slow
def test_update_in_many_buckets_reaches_every_engine_bit_exact(p2p_engines, engine_model):
    from miles_transports.p2p import P2PTransport

    urls, _ = p2p_engines
    weights = new_weights(engine_model, seed=11)
    # One source feeding two engines: the first is written in line, the last in the background.
    transport = P2PTransport(bucket_mb=SMALL_BUCKET_MB, timeout_s=60, check_equal=True)
    transport.connect(urls, rank=0, world_size=1, device="cpu")
    try:
        stats = transport.send(iter(weights.items()), version=3)
        expected = list(iter_buckets(weights.items(), int(SMALL_BUCKET_MB * MiB)))
        assert stats.buckets == len(expected) > 3
        model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        assert stats.metrics["p2p_model_bytes"] == model_bytes
        assert stats.metrics["p2p_targets"] == 2
        assert stats.bytes_sent >= 2 * model_bytes  # every byte went to both engines (plus alignment)
        for url in urls:
            assert engine_version(url) == 3
            assert_engine_holds(url, weights)

        # The buffers grew for the embedding (larger than a bucket); a second update reuses them.
        weights2 = new_weights(engine_model, seed=12)
        transport.send(iter(weights2.items()), version=4)
        for url in urls:
            assert engine_version(url) == 4
            assert_engine_holds(url, weights2)
    finally:
        transport.close()


@needs_mooncake
@pytest.mark.slow
def test_two_sources_each_write_to_their_planned_engine(p2p_engines, engine_model):
    from miles_transports.p2p import P2PTransport

    urls, _ = p2p_engines
    weights = new_weights(engine_model, seed=21)
    ranks = [P2PTransport(bucket_mb=SMALL_BUCKET_MB, timeout_s=60, dtype="bfloat16") for _ in range(2)]
    try:
        for rank, transport in enumerate(ranks):
            transport.connect(urls, rank=rank, world_size=2, device="cpu")
        ranks[0].send(iter(weights.items()), version=31)
        # Rank 0 feeds engine 0 only: engine 1 waits for rank 1.
        assert engine_version(urls[0]) == 31 and engine_version(urls[1]) != 31
        ranks[1].send(iter(weights.items()), version=31)
        as_sent = {name: t.to(torch.bfloat16) for name, t in weights.items()}  # option dtype: bfloat16
        for url in urls:
            assert engine_version(url) == 31
            assert_engine_holds(url, as_sent)
    finally:
        for transport in ranks:
            transport.close()


@needs_mooncake
@pytest.mark.slow
def test_a_refused_bucket_names_the_tensor_and_the_engine_keeps_its_weights(p2p_engines, engine_model):
    from miles_transports.p2p import P2PTransport

    urls, _ = p2p_engines
    url = urls[0]
    before = call(url, "/weights_checker", {"action": "checksum"})
    version = engine_version(url)
    weights = new_weights(engine_model, seed=41)
    bad = list(weights.items())
    bad[len(bad) // 2] = (bad[len(bad) // 2][0], torch.zeros(7))  # a later bucket does not fit the model
    transport = P2PTransport(bucket_mb=SMALL_BUCKET_MB, timeout_s=60)
    transport.connect([url], rank=0, world_size=1, device="cpu")
    try:
        with pytest.raises(EngineError, match=rf"bucket \d+ to engine {url}.*{bad[len(bad) // 2][0]}.*shape"):
            transport.send(iter(bad), version=version + 1)
        assert engine_version(url) == version
        assert call(url, "/weights_checker", {"action": "checksum"}) == before  # staged buckets were dropped

        transport.send(iter(weights.items()), version=version + 2)  # the transport is still usable
        assert engine_version(url) == version + 2
        assert_engine_holds(url, weights)
    finally:
        transport.close()


@needs_mooncake
@pytest.mark.slow
def test_engine_endpoints_refuse_bad_requests(p2p_engines):
    urls, _ = p2p_engines
    url = urls[1]
    call(url, "/p2p/close")
    with pytest.raises(EngineError, match=r"/p2p/apply: .*POST /p2p/init first"):
        call(url, "/p2p/apply", {"session": "x", "names": [], "dtypes": [], "shapes": [], "offsets": []})
    info = call(url, "/p2p/init", {"bucket_bytes": 4096})
    assert info["buffer_len"] == 4096 and info["session"].startswith("127.0.0.1:")
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "offsets": [4096]}
    with pytest.raises(EngineError, match="not this engine's P2P session"):
        call(url, "/p2p/apply", {"session": "127.0.0.1:1", **body})
    with pytest.raises(EngineError, match="outside the receive buffer of 4096 bytes"):
        call(url, "/p2p/apply", {"session": info["session"], **body})
    with pytest.raises(EngineError, match="protocol"):
        call(url, "/p2p/init", {"bucket_bytes": 4096, "protocol": "smoke-signals"})
    # Another size keeps the session and replaces the buffer.
    again = call(url, "/p2p/init", {"bucket_bytes": 8192})
    assert again["session"] == info["session"] and again["buffer_len"] == 8192
    assert call(url, "/p2p/close")["message"] == "P2P receiver closed."


@needs_mooncake
@pytest.mark.slow
def test_an_engine_that_cannot_be_reached_fails_connect_naming_it():
    import socket

    from miles_transports.p2p import P2PTransport

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    transport = P2PTransport(bucket_mb=1, timeout_s=5)
    with pytest.raises(EngineError, match=rf"{dead}/p2p/init"):
        transport.connect([dead], rank=0, world_size=1, device="cpu")
    transport.close()


@needs_mooncake
def test_a_server_without_p2p_endpoints_is_named():
    """An SGLang server (here: any HTTP server that answers 404) cannot take P2P updates."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from miles_transports.p2p import P2PTransport

    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self):  # http.server's naming
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    transport = P2PTransport(bucket_mb=1, timeout_s=5)
    try:
        with pytest.raises(EngineError, match=rf"engine {url}.*no /p2p/init endpoint.*embedded engine"):
            transport.connect([url], rank=0, world_size=1, device="cpu")
    finally:
        transport.close()
        server.shutdown()
        server.server_close()


@needs_mooncake
@pytest.mark.slow
@pytest.mark.parametrize(
    ("hangs", "expected"),
    [
        # Smallest tensors first: bucket 0 fits the buffers, so the Mooncake write is what hangs.
        ("write", r"bucket 0 to engine {url}: writing \d+ bytes .* within timeout_s = 3 s"),
        # The embedding first: bucket 0 needs bigger buffers, so the engine's /p2p/init is what hangs.
        ("http", r"bucket 0 to engine {url} \(growing its buffer\): .*/p2p/init: no answer within 3.0 s"),
    ],
    ids=["write", "http"],
)
def test_a_stopped_engine_fails_the_update_within_the_timeout_naming_it(
    p2p_engines, engine_model, hangs, expected
):
    """SIGSTOP after connect: the engine never answers; the error comes at timeout_s, naming it and the bucket."""
    from miles_transports.p2p import P2PTransport

    urls, pids = p2p_engines
    url, pid = urls[1], pids[1]
    version = engine_version(url)
    weights = list(new_weights(engine_model, seed=51).items())
    transport = P2PTransport(bucket_mb=SMALL_BUCKET_MB, timeout_s=3)
    transport.connect([url], rank=0, world_size=1, device="cpu")
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=expected.format(url=url)):
            transport.send(iter(weights[::-1] if hangs == "write" else weights), version=version + 1)
        assert time.monotonic() - t0 < 15
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        assert engine_version(url) == version  # nothing was applied
        with pytest.raises(EngineError, match="not usable since"):
            transport.send(iter(weights), version=version + 2)
    finally:
        transport.close()
    assert engine_version(url) == version


# ------------------------------------------------------------ the FSDP backend


@needs_mooncake
@pytest.mark.slow
def test_fsdp_ranks_update_engines_over_p2p(p2p_engines, engine_model, tmp_path):
    """Two FSDP ranks, two engines: each rank writes to its own engine; engines hold the trained weights."""
    from fsdp.helpers import make_batch, make_spec
    from safetensors.torch import load_file

    from miles_fsdp.backend import FSDPBackend

    urls, _ = p2p_engines
    spec = make_spec(
        engine_model,
        2,
        transport=P2P,
        engine_urls=urls,
        transport_options={"bucket_mb": SMALL_BUCKET_MB, "timeout_s": 60, "check_equal": True},
        train={"lr": 1e-2},
    )
    backend = FSDPBackend()
    try:
        backend.setup(spec)
        for version in (61, 62):
            backend.train_step(make_batch(4, seed=version))
            stats = backend.update_weights(version)
            assert stats.version == version and stats.buckets > 3
            assert stats.metrics["p2p_targets"] == 1  # rank 0's share of the plan
            export = tmp_path / f"v{version}"
            backend.export_hf(str(export))
            trained = {}
            for path in export.glob("*.safetensors"):
                trained.update(load_file(str(path)))
            for url in urls:
                assert engine_version(url) == version
                assert_engine_holds(url, trained)
    finally:
        backend.shutdown()
