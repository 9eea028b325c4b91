"""LoRA on the megatron backend on one CUDA GPU (scripts/gpu-tests.sh -k megatron_lora; skipped without CUDA).

bf16 adapter steps through megatron's DDP and optimizer (FP32 masters of the adapter only) lower
the loss and leave the base untouched; the export loads with peft onto the HF model with the
trainer's log-probs (float32); a dist-checkpoint holds only the adapter and its optimizer state and
resumes exactly; ``miles run`` with ``backend: megatron`` and a ``lora`` section finishes with only
the adapter travelling to the engine.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from megatron_helpers import cuda_run, make_batch

from miles.interfaces import BackendSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _spec(path, dtype="bfloat16", lr=2e-2) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss="sft",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={
            "train": {"lr": lr, "micro_batch_size": 2, "grad_clip": 1.0},
            "megatron": {"params_dtype": dtype, "layer_spec": "local"},
        },
        config={"lora": {"rank": 8, "alpha": 16.0, "target_modules": TARGETS}},
    )


def test_bf16_lora_steps_train_only_the_adapter(tiny, backends):
    backend = backends(_spec(tiny))
    trainer = backend.trainer
    named = dict(trainer.gpt.named_parameters())
    adapter = {n for n in named if ".lora_" in n}
    assert adapter and all(p.requires_grad == (n in adapter) for n, p in named.items())
    base = {n: p.detach().clone() for n, p in named.items() if n not in adapter}
    batch = make_batch(6, seed=1)
    losses = [backend.train_step(batch)["train/loss"] for _ in range(5)]
    print("megatron bf16 lora sft losses", losses)
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(named[n], t) for n, t in base.items())
    # megatron's optimizer holds the adapter only (its FP32 masters and Adam moments).
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    assert sum(p.numel() for p in params) == sum(named[n].numel() for n in adapter)


def test_the_export_loads_with_peft_and_a_checkpoint_resumes(tiny, backends, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batches = [make_batch(6, seed=20 + i) for i in range(3)]
    backend = backends(_spec(tiny, dtype="float32"))
    backend.train_step(batches[0])
    backend.save_checkpoint(str(tmp_path / "ckpt"))
    want = backend.train_step(batches[1])["train/loss"]
    backend.export_hf(str(tmp_path / "final"))
    ours = backend.score(batches[2].samples, ["old_logprobs"])["old_logprobs"]
    model = (
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), str(tmp_path / "final")
        )
        .cuda()
        .eval()
    )
    for sample, row in zip(batches[2].samples, ours, strict=True):
        ids = torch.tensor([sample.prompt_ids + sample.response_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        p = len(sample.prompt_ids)
        ref = [logp[p - 1 + j, t].item() for j, t in enumerate(sample.response_ids)]
        assert max(abs(a - b) for a, b in zip(row, ref, strict=True)) < 1e-4
    backend.shutdown()
    marker = json.loads((tmp_path / "ckpt" / "miles_megatron.json").read_text())
    assert marker["lora"]["rank"] == 8
    resumed = backends(_spec(tiny, dtype="float32"))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = resumed.train_step(batches[1])["train/loss"]
    print("megatron lora resume", want, got)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_miles_run_with_megatron_lora_on_cuda(tmp_path):
    lora = ["lora.rank=8", "lora.alpha=16", f"lora.target_modules={json.dumps(TARGETS)}"]
    rows, run_dir = cuda_run(tmp_path, "megatron.layer_spec=local", "train.lr=0.01", *lora)
    final = os.path.join(run_dir, "final")
    from safetensors.torch import load_file

    adapter = load_file(os.path.join(final, "adapter_model.safetensors"))
    print(
        "megatron lora run",
        [{k: r.get(k) for k in ("step", "train/loss", "weight_sync/bytes")} for r in rows],
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {r["weight_sync/bytes"] for r in rows} == {sum(t.numel() * 4 for t in adapter.values())}
    assert rows[0]["weight_sync/checked_tensors"] == len(adapter)
