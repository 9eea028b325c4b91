"""LoRA on the Megatron backend's CPU trainer (``megatron.device: cpu``, float32).

Only the adapter trains (the base is bit-for-bit unchanged, the optimizer holds only adapter
state), a step lowers the loss, the export is a peft directory that ``peft`` loads onto the HF
model with the trainer's log-probs, a checkpoint holds only the adapter and its optimizer state
and resumes exactly, and TP = 2 (gloo) trains the same adapter as one rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from megatron_helpers import make_batch, make_checkpoint
from safetensors.torch import load_file

from miles.errors import ModelError
from miles.interfaces import BackendSpec
from miles_megatron.backend import MegatronBackend

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
# Fused slots targeted partly (q and v of linear_qkv, gate of linear_fc1) and whole (o_proj, down_proj).
PARTIAL = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def lora_spec(path: Path, targets: list[str], tp: int = 1, loss: str = "sft", **lora) -> BackendSpec:
    return BackendSpec(
        model_path=str(path),
        loss=loss,
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=TEMPERATURE,
        options={
            # eps 1e-4: A's gradient starts near zero (B is zero), where Adam would amplify rounding noise.
            "train": {"lr": 2e-2, "eps": 1e-4, "micro_batch_size": 2, "grad_clip": 1.0, "weight_decay": 0.1},
            "megatron": {"device": "cpu", "params_dtype": "float32", "num_ranks": tp, "tensor_parallel": tp},
        },
        config={"lora": {"rank": 4, "alpha": 8.0, "target_modules": targets, **lora}},
    )


def peft_logprobs(base: Path, adapter: Path, samples) -> list[list[float]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter)
    )
    model.eval()
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
            lp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            p = len(s.prompt_ids)
            out.append([float(lp[p + j - 1, t]) for j, t in enumerate(s.response_ids)])
    return out


def assert_close(got: list[list[float]], want: list[list[float]], tol: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=tol)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("lora-base"), tie_word_embeddings=False)


def test_only_the_adapter_trains_exports_as_peft_and_resumes_exactly(base, tmp_path):
    batches = [make_batch(6, seed=40 + i, step=i) for i in range(3)]
    probe = make_batch(5, seed=99).samples
    backend = MegatronBackend()
    backend.setup(lora_spec(base, PARTIAL))
    try:
        trainer = backend.trainer
        named = dict(trainer.gpt.named_parameters())
        adapter = {n for n in named if ".lora_" in n}
        # q and v of the fused linear_qkv, gate of linear_fc1, o_proj, down_proj: one A and B each.
        assert adapter == {
            f"decoder.layers.{i}.{slot}.lora_{f}.{part}"
            for i in range(2)
            for slot, part in [
                ("self_attention.linear_qkv", "q_proj"),
                ("self_attention.linear_qkv", "v_proj"),
                ("self_attention.linear_proj", "o_proj"),
                ("mlp.linear_fc1", "gate_proj"),
                ("mlp.linear_fc2", "down_proj"),
            ]
            for f in "AB"
        }
        assert all(p.requires_grad == (n in adapter) for n, p in named.items())
        base_before = {n: p.detach().clone() for n, p in named.items() if n not in adapter}
        # B starts at zero: before any step the model is its base (the HF model's log-probs).
        from transformers import AutoModelForCausalLM

        start = backend.score(probe, ["old_logprobs"])["old_logprobs"]
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        with torch.no_grad():
            for s, row in zip(probe, start, strict=True):
                lp = torch.log_softmax(
                    hf(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0] / TEMPERATURE, -1
                )
                p = len(s.prompt_ids)
                assert row == pytest.approx(
                    [float(lp[p + j - 1, t]) for j, t in enumerate(s.response_ids)], abs=1e-5
                )

        # A step lowers the loss (the same batch again: its negative log-likelihood goes down).
        first = backend.train_step(batches[0])["train/loss"]
        again = backend.train_step(batches[0])["train/loss"]
        assert again < first
        backend.train_step(batches[1])
        backend.save_checkpoint(str(tmp_path / "ckpt"))
        want_loss = backend.train_step(batches[2])["train/loss"]
        want_adapter = {n: named[n].detach().clone() for n in adapter}

        assert all(torch.equal(named[n], t) for n, t in base_before.items())  # the base never moved
        assert all(float(named[n].abs().max()) > 0 for n in adapter if ".lora_B." in n)  # B trained from 0
        state = trainer.optimizer.state
        assert {id(p) for p in state} == {id(named[n]) for n in adapter}  # AdamW state: the adapter's only
        assert all({"exp_avg", "exp_avg_sq"} <= set(s) for s in state.values())

        # The export is a peft adapter directory with the trainer's function.
        backend.export_hf(str(tmp_path / "final"))
        files = sorted(os.listdir(tmp_path / "final"))
        assert files[:2] == ["adapter_config.json", "adapter_model.safetensors"]
        config = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 8.0
        assert sorted(config["target_modules"]) == sorted(PARTIAL)
        ours = backend.score(probe, ["old_logprobs"])["old_logprobs"]
        assert_close(ours, peft_logprobs(base, tmp_path / "final", probe), 1e-5)
        assert (
            max(abs(a - b) for r, s in zip(ours, start, strict=True) for a, b in zip(r, s, strict=True))
            > 1e-3
        )
    finally:
        backend.shutdown()

    # The checkpoint holds the adapter and its optimizer state only (plus the base's reference).
    rank_dir = tmp_path / "ckpt" / "cpu" / "rank00000"
    saved = load_file(str(rank_dir / "model.safetensors"))
    assert set(saved) == adapter
    optimizer = torch.load(rank_dir / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(adapter)
    marker = json.loads((tmp_path / "ckpt" / "miles_megatron.json").read_text())
    assert marker["lora"]["base"]["path"] == str(base) and marker["lora"]["rank"] == 4

    resumed = MegatronBackend()
    resumed.setup(lora_spec(base, PARTIAL))
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert resumed.trainer.optimizer_steps == 3
        assert resumed.train_step(batches[2])["train/loss"] == want_loss
        got = dict(resumed.trainer.gpt.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in want_adapter.items())
    finally:
        resumed.shutdown()

    # ... and refused as another adapter shape, on another base, or without a lora section.
    other = make_checkpoint("qwen3", tmp_path / "other", seed=5, tie_word_embeddings=False)
    for spec, match in [
        (lora_spec(base, ["q_proj"]), "resume with the same lora shape"),
        (lora_spec(other, PARTIAL), "trained on base"),
        (dataclasses.replace(lora_spec(base, PARTIAL), config={}), "resume it with its lora section"),
    ]:
        wrong = MegatronBackend()
        wrong.setup(spec)
        try:
            with pytest.raises(ModelError, match=match):
                wrong.load_checkpoint(str(tmp_path / "ckpt"))
        finally:
            wrong.shutdown()


def test_tensor_parallel_lora_on_gloo_trains_the_same_adapter(base, tmp_path):
    """TP = 2: the column-parallel B and row-parallel A are split, the gradients reduced as megatron's
    mappings do; the adapter (and its peft export) equals the one-rank run's."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    batches = [make_batch(6, seed=60 + i, step=i, positive=True) for i in range(2)]
    exports = {}
    for tp in (1, 2):
        backend = MegatronBackend()
        backend.setup(lora_spec(base, targets, tp=tp, loss="ppo_clip"))
        try:
            for batch in batches:
                backend.train_step(batch)
            exports[tp] = tmp_path / f"tp{tp}"
            backend.export_hf(str(exports[tp]))
            if tp == 2:
                ours = backend.score(batches[0].samples, ["old_logprobs"])["old_logprobs"]
        finally:
            backend.shutdown()
    one, two = (load_file(str(exports[tp] / "adapter_model.safetensors")) for tp in (1, 2))
    assert set(one) == set(two) and len(one) == 2 * 2 * len(targets)
    for name in one:
        # Summation order differs between the layouts (2026-12-07: at most 1.1e-6 apart).
        assert torch.allclose(one[name], two[name], atol=5e-6), name
    assert_close(ours, peft_logprobs(base, exports[2], batches[0].samples), 1e-5)


def test_qwen2_with_biases_and_tied_embeddings_exports_what_it_trains(tmp_path):
    """Qwen2 (q/k/v biases, tied embeddings), the fused linears' middle parts only (k of linear_qkv, up of
    linear_fc1), adapter dropout in training: the export equals the trainer under peft (both in eval mode)."""
    base = make_checkpoint("qwen2", tmp_path / "qwen2", tie_word_embeddings=True)
    batch = make_batch(4, seed=7)
    backend = MegatronBackend()
    backend.setup(lora_spec(base, ["k_proj", "up_proj"], dropout=0.1))
    try:
        backend.train_step(batch)
        backend.export_hf(str(tmp_path / "final"))
        ours = backend.score(batch.samples, ["old_logprobs"])["old_logprobs"]
    finally:
        backend.shutdown()
    adapter = load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
    assert {n.split(".")[-3] for n in adapter} == {"k_proj", "up_proj"}
    assert json.loads((tmp_path / "final" / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    assert all(float(t.abs().max()) > 0 for n, t in adapter.items() if ".lora_B." in n)
    assert_close(ours, peft_logprobs(base, tmp_path / "final", batch.samples), 1e-5)
