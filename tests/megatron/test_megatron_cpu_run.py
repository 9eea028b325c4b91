"""The Megatron backend's CPU trainer (``megatron.device: cpu``) through whole runs: its own
checkpoints (per-rank model shards and torch's AdamW state) resume bit for bit, and ``miles run``
with ``backend: megatron`` trains, keeps the engine serving the trained weights, saves and resumes.
"""

from __future__ import annotations

import json

import pytest
import torch
from megatron_helpers import cpu_run_config, make_batch, make_checkpoint, read_rows

from miles.errors import ComponentError
from miles.interfaces import BackendSpec
from miles_megatron.backend import MegatronBackend

pytestmark = pytest.mark.slow


def _spec(path) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="ppo_clip",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={
            "train": {"lr": 1e-2, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 1.0, "weight_decay": 0.1},
            "megatron": {"device": "cpu", "params_dtype": "float32"},
        },
    )


def _params(backend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.trainer.gpt.named_parameters()}


def test_a_cpu_checkpoint_resumes_bit_for_bit_and_a_cuda_one_is_refused(tmp_path):
    path = make_checkpoint("qwen3", tmp_path / "hf")
    batches = [make_batch(4, seed=70 + i) for i in range(3)]
    first = MegatronBackend()
    first.setup(_spec(path))
    try:
        losses = []
        for i, batch in enumerate(batches):
            losses.append(first.train_step(batch)["train/loss"])
            if i == 1:
                first.save_checkpoint(str(tmp_path / "ckpt"))
        want = _params(first)
    finally:
        first.shutdown()
    assert sorted(p.name for p in (tmp_path / "ckpt" / "cpu" / "rank00000").iterdir()) == [
        "model.safetensors",
        "optimizer.pt",
        "param_names.json",  # the optimizer's parameters by name (a resume under another PP reads by name)
    ]
    resumed = MegatronBackend()
    resumed.setup(_spec(path))
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert resumed.trainer.optimizer_steps == 2
        assert resumed.train_step(batches[2])["train/loss"] == losses[2]
        got = _params(resumed)
        assert all(torch.equal(got[k], p) for k, p in want.items())
        # A checkpoint megatron's optimizer wrote on CUDA (its marker as save_checkpoint writes it).
        marker = json.loads((tmp_path / "ckpt" / "miles_megatron.json").read_text())
        (tmp_path / "cuda").mkdir()
        (tmp_path / "cuda" / "miles_megatron.json").write_text(
            json.dumps({**marker, "optimizer": "megatron"})
        )
        with pytest.raises(
            ComponentError, match=r"written by the megatron trainer on CUDA .* this run is on CPU"
        ):
            resumed.load_checkpoint(str(tmp_path / "cuda"))
    finally:
        resumed.shutdown()


def test_miles_run_trains_with_megatron_on_cpu_and_resumes(tmp_path, monkeypatch):
    from miles.loop import train

    def config(steps: int):
        return cpu_run_config(tmp_path, monkeypatch, steps)

    result = train(config(3))
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/grad_norm"] > 0 for r in rows)
    # The engine served the weights the megatron trainer exported after each update.
    assert all(r["correction/abs_dev"] < 1e-4 for r in rows)
    assert [r["engine/weight_version"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "default" / "final" / "model.safetensors").is_file()

    result = train(config(4), resume=True)
    rows = read_rows(result.metrics_path)
    assert [r["step"] for r in rows][-2:] == [2, 3]  # from the step-2 checkpoint
    assert rows[-1]["correction/abs_dev"] < 1e-4
