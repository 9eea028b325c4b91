"""A LoRA weight update carries only the adapter, through broadcast and colocated, to real engines."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fsdp.helpers import make_batch

from lora.helpers import forward_logprobs, merged_model
from lora.test_fsdp_lora import lora_spec

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 33, 2, 90, 64]


@pytest.fixture(scope="module")
def handoff_dir():
    from miles_transports.colocated import make_handoff_dir

    path = make_handoff_dir(prefix="miles-test-lora-handoff-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def engine_url(tiny_base: Path, handoff_dir: str, tmp_path_factory: pytest.TempPathFactory):
    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec

    launcher = EmbeddedLauncher(startup_timeout_s=120)
    options = {"handoff_dir": handoff_dir, "torch_threads": 1, "max_batch_size": 4, "dtype": "float32"}
    try:
        [url] = launcher.launch(
            [EngineSpec(model_path=str(tiny_base), options=options)], str(tmp_path_factory.mktemp("logs"))
        )
        yield url
    finally:
        launcher.shutdown()


@pytest.mark.parametrize("transport", ["broadcast", "colocated"])
def test_update_sends_only_the_adapter_and_the_engine_serves_it(
    transport, tiny_base, engine_url, handoff_dir, tmp_path, backend_factory
):
    from miles.engines.client import SyncEngineClient
    from miles.types import SamplingParams

    options = {"check_equal": True, "bucket_mb": 1.0}
    if transport == "colocated":
        options["handoff_dir"] = handoff_dir
    spec = lora_spec(tiny_base, tmp_path)
    spec.transport, spec.engine_urls, spec.transport_options = transport, [engine_url], options
    backend = backend_factory(spec)
    backend.train_step(make_batch(6, seed=1, positive=True))
    stats = backend.update_weights(1)
    backend.export_hf(str(tmp_path / "v1"))

    # Only the adapter travelled: 2 layers x (q, v, down) x (A + B), float32.
    from safetensors.torch import load_file

    adapter = load_file(str(tmp_path / "v1" / "adapter_model.safetensors"))
    assert stats.bytes_sent == sum(t.numel() * 4 for t in adapter.values())
    assert stats.metrics.get("checked_tensors") == len(adapter)  # the weight check compared every factor
    base_bytes = sum(p.numel() * 4 for p in merged_model(tiny_base, None).parameters())
    assert stats.bytes_sent < 0.2 * base_bytes

    with SyncEngineClient(engine_url, timeout=60) as client:
        info = client.get_server_info()
        [served] = [a for a in info["lora_adapters"] if a["name"] == "default"]
        assert served["weight_version"] == "1"
        out = client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0), lora_path="default")
        base = client.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0))
    merged = merged_model(tiny_base, tmp_path / "v1")
    assert out.output_logprobs == pytest.approx(forward_logprobs(merged, PROMPT, out.output_ids), abs=1e-4)
    # The base stayed as it was (the check randomised only the adapter), and is still served.
    plain = merged_model(tiny_base, None)
    assert base.output_logprobs == pytest.approx(forward_logprobs(plain, PROMPT, base.output_ids), abs=1e-4)
    assert (
        torch.tensor(out.output_logprobs)
        .sub(torch.tensor(forward_logprobs(plain, PROMPT, out.output_ids)))
        .abs()
        .max()
        > 1e-3
    )


def test_http_endpoints_load_serve_and_unload(engine_url, adapters, tiny_base):
    from miles.engines.client import SyncEngineClient
    from miles.errors import EngineError
    from miles.types import SamplingParams

    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    with SyncEngineClient(engine_url, timeout=60) as client:
        client.load_lora_adapter("http-a", str(adapters["a"]))
        out = client.generate(PROMPT, params, lora_path="http-a")
        merged = merged_model(tiny_base, adapters["a"])
        assert out.output_logprobs == pytest.approx(
            forward_logprobs(merged, PROMPT, out.output_ids), abs=1e-4
        )
        client.unload_lora_adapter("http-a")
        with pytest.raises(EngineError, match="not a loaded adapter"):
            client.generate(PROMPT, params, lora_path="http-a")
        with pytest.raises(EngineError, match="not a peft adapter directory"):
            client.load_lora_adapter("bad", str(tiny_base))
