"""Multi-LoRA on the FSDP backend: several adapters over one base, trained in one batch.

Each adapter's rows of a mixed batch train it exactly as a run of that adapter alone on those
rows; an adapter with no rows takes no step and is not sent; each export loads with peft; a
checkpoint resumes every adapter with its optimizer state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fsdp.helpers import make_batch, make_spec

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
A = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"], "lr": 5e-2}
B = {"rank": 2, "alpha": 4.0, "target_modules": ["o_proj", "gate_proj"], "lr": 2e-2}


def spec_of(model_path: Path, tmp_path: Path, lora: dict, lr: float = 5e-2):
    from miles.config import load_recipe

    overrides = [f"model.path={model_path}", f"run.output_dir={tmp_path}", "run.name=multi"]
    overrides.append(f"lora={json.dumps(lora)}")
    config = load_recipe("default", overrides).model_dump(mode="json")
    return make_spec(str(model_path), temperature=TEMPERATURE, train={"lr": lr}, config=config)


def multi_spec(model_path: Path, tmp_path: Path):
    return spec_of(model_path, tmp_path, {"adapters": {"math": A, "code": B}})


def tagged(batch, names: list[str]):
    from miles.config.schema import ADAPTER_KEY

    for sample, name in zip(batch.samples, names, strict=True):
        sample.metadata[ADAPTER_KEY] = name
    return batch


def only(batch, name: str):
    from miles.config.schema import ADAPTER_KEY
    from miles.train_rows import sub_batch

    return sub_batch(batch, [i for i, s in enumerate(batch.samples) if s.metadata[ADAPTER_KEY] == name])


def mixed(step: int):
    return tagged(make_batch(6, seed=3 + step, step=step), ["math", "code", "math", "code", "code", "math"])


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert sorted(got) == sorted(want)
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)


def peft_logprobs(base: Path, adapter: Path, samples) -> list[list[float]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
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


def test_two_adapters_in_one_batch_train_as_each_alone(tiny_base, tmp_path, backend_factory):
    from miles.train_rows import OLD_LOGPROBS

    multi = backend_factory(multi_spec(tiny_base, tmp_path))
    m0 = multi.train_step(mixed(0))
    for name in ("math", "code"):
        assert m0[f"lora/{name}/stepped"] == 1.0
        assert f"lora/{name}/train/loss" in m0 and f"lora/{name}/train/grad_norm" in m0
    assert m0["lora/math/train/lr"] == pytest.approx(A["lr"]) and m0["lora/code/train/lr"] == pytest.approx(
        B["lr"]
    )
    assert m0["train/optimizer_steps"] == 2.0
    assert multi.unsent_adapters() == ["math", "code"]
    multi.update_weights(1)
    assert multi.unsent_adapters() == []
    # A batch of adapter math's rows only: code takes no step and is not sent with the next update.
    m1 = multi.train_step(only(mixed(1), "math"))
    assert (
        m1["lora/math/stepped"] == 1.0 and m1["lora/code/stepped"] == 0.0 and "lora/code/train/loss" not in m1
    )
    assert multi.unsent_adapters() == ["math"]
    ckpt = tmp_path / "ckpt"
    multi.save_checkpoint(str(ckpt))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora"]["adapters"] == ["math", "code"] and "scheduler/code" in state
    export = tmp_path / "final"
    multi.export_hf(str(export))
    # Each exported adapter loads with peft and gives the trainer's log-probs of its rows.
    probe = mixed(2)
    scored = multi.score(probe.samples, [OLD_LOGPROBS])[OLD_LOGPROBS]
    for name in ("math", "code"):
        rows = [i for i, s in enumerate(probe.samples) if s.metadata["lora_adapter"] == name]
        ref = peft_logprobs(tiny_base, export / name, [probe.samples[i] for i in rows])
        for i, want in zip(rows, ref, strict=True):
            assert scored[i] == pytest.approx(want, abs=1e-5)
    m2 = multi.train_step(mixed(2))  # one more step of both: what the resumed trainer must repeat
    multi.export_hf(str(tmp_path / "after"))
    multi.shutdown()

    # Adapter math alone, in the single-adapter form (same shape, same rate, the same initial factors:
    # it is the first adapter either way): the same steps on its rows give the same adapter.
    shape = {k: v for k, v in A.items() if k != "lr"}
    single = backend_factory(spec_of(tiny_base, tmp_path / "single", {"name": "math", **shape}, lr=A["lr"]))
    single.train_step(only(mixed(0), "math"))
    single.train_step(only(mixed(1), "math"))
    single.export_hf(str(tmp_path / "single-a"))
    single.shutdown()
    assert_same(tensors(tmp_path / "single-a"), tensors(export / "math"))

    # Adapter code alone (a multi-LoRA trainer given only code's rows): the same adapter as in the
    # mixed batch. The same trainer then resumes the checkpoint: both adapters and both optimizers
    # come back (what it trained alone is overwritten), and the engines would get both again.
    alone = backend_factory(multi_spec(tiny_base, tmp_path / "alone"))
    alone.train_step(only(mixed(0), "code"))
    alone.export_hf(str(tmp_path / "alone"))
    assert_same(tensors(tmp_path / "alone" / "code"), tensors(export / "code"))
    alone.load_checkpoint(str(ckpt))
    assert alone.unsent_adapters() == ["math", "code"]
    again = alone.train_step(mixed(2))
    for key in ("lora/math/train/loss", "lora/code/train/loss", "lora/math/train/grad_norm"):
        assert again[key] == pytest.approx(m2[key], abs=1e-6)
    alone.export_hf(str(tmp_path / "resumed-final"))
    for name in ("math", "code"):
        assert_same(tensors(tmp_path / "resumed-final" / name), tensors(tmp_path / "after" / name))
