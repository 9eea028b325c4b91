"""One GPU test flow shared by the GPU transport tests: train on CUDA, update an engine, compare.

An embedded engine is launched on ``engine_device``; an FSDP trainer on ``cuda`` takes one train
step per version and sends its weights through ``transport`` (small buckets, so an update spans
several of them, with the weight-equality check on); the exported policy must be what the engine
serves, at the last version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def train_and_update_engine(
    engine_model: str,
    tmp_path: Path,
    *,
    engine_device: str,
    transport: str,
    transport_options: dict[str, Any],
    versions: int = 1,
) -> None:
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
            [EngineSpec(model_path=engine_model, options={"device": engine_device, "dtype": "float32"})],
            str(tmp_path / "logs"),
        )
        spec = make_spec(
            engine_model,
            1,
            transport=transport,
            engine_urls=urls,
            transport_options={"bucket_mb": 0.01, "check_equal": True, **transport_options},
            train={"lr": 1e-2},
            fsdp={"device": "cuda"},
        )
        backend.setup(spec)
        for version in range(1, versions + 1):
            backend.train_step(make_batch(4, seed=30 + version))
            stats = backend.update_weights(version)
            assert stats.buckets > 1 and stats.bytes_sent > 0
        backend.export_hf(str(tmp_path / "hf"))
        trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        assert_engines_serve(urls, trained, version=versions)
    finally:
        backend.shutdown()
        launcher.shutdown()
