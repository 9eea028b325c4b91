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
    from transports.gpu_round_trip import train_and_update_engine

    train_and_update_engine(
        engine_model,
        tmp_path,
        engine_device="cuda:1",
        transport="broadcast",
        transport_options={"flatten": flatten},
    )
