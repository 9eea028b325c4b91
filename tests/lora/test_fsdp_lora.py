"""LoRA on the FSDP backend: only the adapter trains and is saved; the export loads with peft."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fsdp.helpers import make_batch, make_spec

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8


def lora_spec(model_path: Path, tmp_path: Path, **lora):
    from miles.config import load_recipe

    options = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"], **lora}
    overrides = [f"model.path={model_path}", f"run.output_dir={tmp_path}", "run.name=lora"]
    overrides += [f"lora.{k}={json.dumps(v)}" for k, v in options.items()]
    config = load_recipe("default", overrides).model_dump(mode="json")
    return make_spec(str(model_path), temperature=TEMPERATURE, train={"lr": 5e-2}, config=config)


def peft_logprobs(base: Path, adapter: str, batch) -> list[list[float]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    )
    model.eval()
    out = []
    with torch.no_grad():
        for s in batch.samples:
            logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
            lp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            p = len(s.prompt_ids)
            out.append([float(lp[p + j - 1, t]) for j, t in enumerate(s.response_ids)])
    return out


def test_lora_trains_only_the_adapter_saves_it_and_exports_a_peft_dir(tiny_base, tmp_path, backend_factory):
    import torch.distributed.checkpoint as dcp

    from miles.errors import ModelError
    from miles.train_rows import OLD_LOGPROBS

    spec = lora_spec(tiny_base, tmp_path)
    backend = backend_factory(spec)
    batch = make_batch(6, seed=3, positive=True)
    before = backend.score(batch.samples, [OLD_LOGPROBS])[OLD_LOGPROBS]
    losses = [
        backend.train_step(make_batch(6, seed=3, positive=True, step=i))["train/loss"] for i in range(3)
    ]
    after = backend.score(batch.samples, [OLD_LOGPROBS])[OLD_LOGPROBS]
    assert losses[-1] < losses[0]  # positive advantages: the likelihood of the batch goes up
    assert sum(map(sum, after)) > sum(map(sum, before))

    ckpt = tmp_path / "ckpt"
    backend.save_checkpoint(str(ckpt))
    keys = list(dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata)
    assert keys and all(".lora_" in k or k.startswith("optim.param_groups") for k in keys), keys[:5]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora"]["base"]["path"] == str(tiny_base)
    assert any(k.startswith("optim.state") and "exp_avg" in k for k in keys)  # adapter optimizer state

    export = tmp_path / "final"
    backend.export_hf(str(export))
    assert sorted(os.listdir(export))[:2] == ["adapter_config.json", "adapter_model.safetensors"]
    ref = peft_logprobs(tiny_base, str(export), batch)
    for got, want in zip(after, ref, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    backend.shutdown()

    # Resume continues the same adapter...
    resumed = backend_factory(lora_spec(tiny_base, tmp_path))
    resumed.load_checkpoint(str(ckpt))
    again = resumed.score(batch.samples, [OLD_LOGPROBS])[OLD_LOGPROBS]
    for got, want in zip(again, after, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    resumed.shutdown()

    # ... and is refused on another base, before any rank reads the checkpoint.
    from engine.helpers import make_tiny_qwen3

    other = make_tiny_qwen3(tmp_path / "other-base", seed=5, tokenizer=True, tie_word_embeddings=False)
    wrong = backend_factory(lora_spec(other, tmp_path))
    with pytest.raises(ModelError, match="trained on base"):
        wrong.load_checkpoint(str(ckpt))
