"""The broadcast transport over NCCL: trainer rank 0 on one GPU, an embedded engine on another."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.slow
@pytest.mark.parametrize("flatten", [False, True], ids=["per-tensor", "flat"])
def test_nccl_broadcast_from_fsdp_to_an_engine_on_another_gpu(engine_model, tmp_path, flatten):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (trainer on cuda:0, engine on cuda:1)")
    from fsdp.helpers import make_batch, make_spec
    from transformers import AutoModelForCausalLM

    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec
    from miles_fsdp.backend import FSDPBackend
    from transports.test_transports import assert_engines_serve

    launcher = EmbeddedLauncher(startup_timeout_s=300)
    backend = FSDPBackend()
    try:
        urls = launcher.launch(
            [EngineSpec(model_path=engine_model, options={"device": "cuda:1", "dtype": "float32"})],
            str(tmp_path / "logs"),
        )
        spec = make_spec(
            engine_model,
            1,
            transport="broadcast",
            engine_urls=urls,
            transport_options={"bucket_mb": 0.01, "flatten": flatten, "check_equal": True},
            train={"lr": 1e-2},
            fsdp={"device": "cuda"},
        )
        backend.setup(spec)
        backend.train_step(make_batch(4, seed=31))
        stats = backend.update_weights(1)
        assert stats.buckets > 1
        backend.export_hf(str(tmp_path / "hf"))
        trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        assert_engines_serve(urls, trained, version=1)
    finally:
        backend.shutdown()
        launcher.shutdown()
