"""LoRA merged on arrival, in one process: the engine's merge of each update onto the unmerged base,
its refusals. The merge is checked against peft's own (``merge_and_unload`` of the trainer's model):
the engine computes ``W_base + alpha/r * B A`` itself, so a wrong conv layout or scale would show here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from miles.config.schema import LoraSection
from miles.engines.client import HANDOFF_LOAD_FORMAT
from miles_diffusion import lora as lora_mod
from miles_diffusion.engine.server import (
    DiffusionEngine,
    EngineRefusal,
    LoadLoraBody,
    UnloadLoraBody,
    UpdateFromTensorBody,
)
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, load_pretrained, save_pretrained

LORA = LoraSection(rank=4, alpha=8, target_modules=["conv1", "conv2", "time_emb_proj"])


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return save_pretrained(build_tiny_model(TinyFlowModelConfig(), seed=0), tmp_path / "base")


def _randomise(peft_model, seed: int) -> None:
    """Every factor away from its initial value (B starts at zero, which would merge to nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _send(engine: DiffusionEngine, handoff: Path, peft_model, version: int) -> None:
    """What the colocated transport does: a safetensors file in the hand-off dir, then the versioned bucket."""
    tensors = {n: t.contiguous() for n, t in lora_mod.adapter_tensors(peft_model, LORA.name)}
    save_file(tensors, str(handoff / f"v{version}.safetensors"))
    engine.update_bucket(
        UpdateFromTensorBody(
            serialized_named_tensors=[f"v{version}.safetensors"],
            load_format=HANDOFF_LOAD_FORMAT,
            weight_version=str(version),
            bucket_index=0,
        )
    )


def _peft_merged(peft_model) -> dict[str, torch.Tensor]:
    """peft's merge of the trainer's adapter into a copy of its base: the reference."""
    return copy.deepcopy(peft_model).merge_and_unload().state_dict()


def test_the_engine_merges_each_update_onto_the_unmerged_base(model_dir: Path, tmp_path: Path) -> None:
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    engine = DiffusionEngine(str(model_dir), handoff_dir=str(handoff))
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    trainer = lora_mod.wrap(load_pretrained(model_dir), LORA, str(model_dir))
    initial = lora_mod.save_adapter(trainer, tmp_path / "initial")
    engine.load_lora(LoadLoraBody(lora_name=LORA.name, lora_path=str(initial)))
    after_load = engine.model.state_dict()
    assert all(torch.equal(after_load[k], base[k]) for k in base)  # B = 0: the base, exactly

    adapted = {f"{m}.weight" for m in lora_mod.check_targets(load_pretrained(model_dir), LORA)}
    assert len(adapted) == 24  # conv1, conv2 and time_emb_proj of the 8 resnet blocks
    results = []
    for version, seed in ((1, 1), (2, 2)):
        _randomise(trainer, seed)
        _send(engine, handoff, trainer, version)
        assert engine.weight_version == version
        merged, reference = engine.model.state_dict(), _peft_merged(trainer)
        assert set(merged) == set(reference) == set(base)
        for name in base:
            if name in adapted:
                torch.testing.assert_close(merged[name], reference[name], rtol=0, atol=1e-6)
                assert not torch.allclose(merged[name], base[name], atol=1e-4)  # the adapter did move it
            else:
                assert torch.equal(merged[name], base[name])  # modules without the adapter: untouched
        results.append({k: merged[k].clone() for k in adapted})
    # The second update replaced the first: base + delta2, not base + delta1 + delta2.
    delta1 = {k: results[0][k] - base[k] for k in adapted}
    for name in adapted:
        gap = (results[1][name] - (_peft_merged(trainer)[name] + delta1[name])).abs().max()
        assert gap > 1e-3
    info = engine.merger.describe()
    assert info is not None and info["name"] == LORA.name and info["scale"] == 2.0 and info["modules"] == 24

    engine.unload_lora(UnloadLoraBody(lora_name=LORA.name))
    restored = engine.model.state_dict()
    assert all(torch.equal(restored[k], base[k]) for k in base)  # back to the base bit for bit


def test_the_engine_refuses_bad_adapters_and_updates(model_dir: Path, tmp_path: Path) -> None:
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    engine = DiffusionEngine(str(model_dir), handoff_dir=str(handoff))
    trainer = lora_mod.wrap(load_pretrained(model_dir), LORA, str(model_dir))
    with pytest.raises(EngineRefusal, match="no adapter is loaded; POST /load_lora_adapter first"):
        _send(engine, handoff, trainer, 1)
    assert engine.weight_version == 0
    with pytest.raises(EngineRefusal, match="is not a peft adapter directory"):
        engine.load_lora(LoadLoraBody(lora_name="default", lora_path=str(tmp_path)))
    engine.load_lora(
        LoadLoraBody(lora_name=LORA.name, lora_path=str(lora_mod.save_adapter(trainer, tmp_path / "a")))
    )
    # An update missing one factor is refused whole (the trainer sends the whole adapter each time).
    tensors = dict(lora_mod.adapter_tensors(trainer, LORA.name))
    tensors.pop(next(iter(tensors)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(handoff / "part.safetensors"))
    body = UpdateFromTensorBody(
        serialized_named_tensors=["part.safetensors"], load_format=HANDOFF_LOAD_FORMAT, weight_version="1"
    )
    with pytest.raises(EngineRefusal, match="must carry the whole adapter; 1 of its tensors are missing"):
        engine.update_bucket(body)
    # A factor of the wrong shape, and full weights while an adapter is merged.
    name, t = next(iter(tensors.items()))
    save_file({name: torch.zeros(t.shape[0] + 1, *t.shape[1:])}, str(handoff / "bad.safetensors"))
    body = UpdateFromTensorBody(
        serialized_named_tensors=["bad.safetensors"], load_format=HANDOFF_LOAD_FORMAT, weight_version="1"
    )
    with pytest.raises(EngineRefusal, match="has shape"):
        engine.update_bucket(body)
    save_file(load_pretrained(model_dir).state_dict(), str(handoff / "full.safetensors"))
    body = UpdateFromTensorBody(
        serialized_named_tensors=["full.safetensors"], load_format=HANDOFF_LOAD_FORMAT, weight_version="1"
    )
    with pytest.raises(EngineRefusal, match=r"is merged into the weights; .*POST /unload_lora_adapter first"):
        engine.update_bucket(body)
    with pytest.raises(EngineRefusal, match="no LoRA adapter 'other' is merged"):
        engine.unload_lora(UnloadLoraBody(lora_name="other"))
    assert engine.weight_version == 0
