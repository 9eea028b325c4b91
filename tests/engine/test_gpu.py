"""The embedded engine on CUDA, and a weight broadcast over NCCL (gloo on a one-GPU machine).

Run on a GPU machine with ``pytest -m gpu tests/engine``; skipped where there is no CUDA.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.helpers import full_forward_logprobs, load_local, make_tiny_qwen3, running_engine
from miles.engines.client import SyncEngineClient
from miles.engines.launchers import free_port
from miles.engines.weight_group import create_weight_group
from miles.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = [7, 3, 9, 1]


def test_cuda_engine_logprobs_and_weight_broadcast(dense_dir: Path, engine_tmp: Path) -> None:
    n = torch.cuda.device_count()
    engine_device = f"cuda:{n - 1}"
    backend = "nccl" if n >= 2 else "gloo"  # two NCCL ranks cannot share one GPU
    sender = "cuda:0" if backend == "nccl" else "cpu"
    params = SamplingParams(max_new_tokens=16, temperature=0.9, seed=3)
    with running_engine(dense_dir, engine_tmp / "logs-gpu", device=engine_device) as url:
        client = SyncEngineClient(url)
        assert client.get_server_info()["device"] == engine_device
        local = load_local(dense_dir).to("cuda:0")
        outs = [client.generate(PROMPT, params) for _ in range(2)]
        assert outs[0].output_ids == outs[1].output_ids  # seeded sampling on a CUDA generator
        expected = full_forward_logprobs(local, PROMPT, outs[0].output_ids, 0.9)
        assert outs[0].output_logprobs == pytest.approx(expected, abs=1e-3)

        other = make_tiny_qwen3(engine_tmp / "gpu-seed5", seed=5)
        new = load_local(other).to(sender)
        tensors = {k: v.detach().contiguous() for k, v in new.named_parameters()}
        port = free_port()
        if backend == "nccl":
            torch.cuda.set_device(0)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, "g", backend)
            group = create_weight_group(
                "127.0.0.1", port, 0, 2, group_name="g", backend=backend, device=sender, timeout_s=120
            )
            assert joined.result(timeout=120)["success"]
            names = list(tensors)
            pending = pool.submit(
                client.update_weights_from_distributed,
                names,
                [str(t.dtype) for t in tensors.values()],
                [list(t.shape) for t in tensors.values()],
                "g",
                9,
            )
            for name in names:
                group.broadcast(tensors[name], src=0)
            assert pending.result(timeout=120)["success"]
            group.destroy()  # trainer side first: must not wait for the engine
            client.destroy_weights_update_group("g")
        out = client.generate(PROMPT, params)
        assert out.weight_version == 9
        expected = full_forward_logprobs(new.to("cuda:0"), PROMPT, out.output_ids, 0.9)
        assert out.output_logprobs == pytest.approx(expected, abs=1e-3)
