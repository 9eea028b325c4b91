"""LoRA in the diffusion backend, in one process (no engine): only the adapter trains and is sent,
checkpoints hold the adapter and the base's digest, the export loads onto the base with peft; and the
lora sections a diffusion run cannot carry, refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config import load_recipe
from miles.errors import ConfigError
from miles.interfaces import BackendSpec
from miles.types import Prompt, Sample, TrainBatch
from miles_diffusion import lora as lora_mod
from miles_diffusion.backend import DiffusionBackend
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, load_pretrained, save_pretrained
from miles_diffusion.payload import split
from miles_diffusion.sampler import SamplerConfig, sample_seeded


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return save_pretrained(build_tiny_model(TinyFlowModelConfig(), seed=0), tmp_path / "base")


def _config(model_dir: Path, tmp_path: Path, *overrides: str):
    return load_recipe(
        "tiny_flow_grpo_lora",
        [f"model.path={model_dir}", f"run.output_dir={tmp_path}", "diffusion.torch_threads=1", *overrides],
    )


def _spec(config, model_dir: Path) -> BackendSpec:
    """What the core's trainer() hands the backend, without engines (nothing to update)."""
    return BackendSpec(
        model_path=str(model_dir),
        loss=str(config.algorithm.loss),
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={"train": config.train.model_dump(), "diffusion": config.diffusion.model_dump()},
        loss_options=config.algorithm.loss_options,
        seed=0,
        config=config.model_dump(mode="json"),
    )


def _batch(model_dir: Path) -> TrainBatch:
    sampler = SamplerConfig(num_steps=8, noise_level=0.7)
    prompts = torch.tensor([0, 0, 1, 1])
    seeds = [5, 6, 7, 8]
    trajectory = sample_seeded(load_pretrained(model_dir), prompts, seeds, sampler)
    samples = [
        Sample(
            prompt=Prompt(index=int(p), prompt=""), group_index=i % 2, payload=payload, reward=float(i % 2)
        )
        for i, (p, payload) in enumerate(zip(prompts, split(trajectory, seeds, sampler, 0), strict=True))
    ]
    return TrainBatch(samples=samples, advantages=[[-1.0], [1.0], [-1.0], [1.0]], step=0)


def test_the_backend_trains_and_checkpoints_the_adapter_only(model_dir: Path, tmp_path: Path) -> None:
    config = _config(model_dir, tmp_path)
    backend = DiffusionBackend()
    backend.setup(_spec(config, model_dir))
    try:
        peft_model = backend._peft
        trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_" in n for n in trainable)
        assert backend._optimizer is not None
        assert sum(len(g["params"]) for g in backend._optimizer.param_groups) == len(trainable)
        base = {n: p.clone() for n, p in peft_model.named_parameters() if not p.requires_grad}
        metrics = backend.train_step(_batch(model_dir))
        assert metrics["train/grad_norm"] > 0
        after = dict(peft_model.named_parameters())
        assert all(torch.equal(after[n], base[n]) for n in base)  # the base is frozen
        b = [p for n, p in after.items() if ".lora_B." in n]
        assert all(float(p.detach().abs().max()) > 0 for p in b)  # every B left zero: the adapter trained
        # The update stream: the adapter alone, under the engine's names.
        sent = dict(lora_mod.adapter_tensors(peft_model, "default"))
        assert len(sent) == 52 and all(".lora_A.default." in n or ".lora_B.default." in n for n in sent)
        assert lora_mod.adapter_bytes(peft_model) == sum(t.numel() * 4 for t in sent.values()) == 92640

        ckpt = tmp_path / "ckpt"
        backend.save_checkpoint(str(ckpt))
        assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and not (ckpt / "model").exists()
        export = tmp_path / "export"
        backend.export_hf(str(export))
        saved = {n: t.clone() for n, t in lora_mod.adapter_state(peft_model).items()}
        # The export loads onto the base with peft and gives the trainer's velocities.
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(load_pretrained(model_dir), str(export)).eval()
        x, t, prompts = torch.randn(2, 3, 16, 16), torch.tensor([0.9, 0.3]), torch.tensor([0, 3])
        with torch.no_grad():
            torch.testing.assert_close(loaded(x, t, prompts), peft_model(x, t, prompts), rtol=0, atol=1e-6)
        backend.train_step(_batch(model_dir))  # move away, then resume from the checkpoint
        backend.load_checkpoint(str(ckpt))
        restored = lora_mod.adapter_state(peft_model)
        assert all(torch.equal(restored[k], saved[k]) for k in saved)
    finally:
        backend.shutdown()

    # A LoRA checkpoint without lora, and on another base, are refused before anything loads.
    full = DiffusionBackend()
    full.setup(_spec(_config(model_dir, tmp_path, "lora=null", "train.lr=0.001"), model_dir))
    try:
        with pytest.raises(
            ConfigError, match="holds a LoRA adapter checkpoint; resume it with its lora section"
        ):
            full.load_checkpoint(str(ckpt))
    finally:
        full.shutdown()
    other = save_pretrained(build_tiny_model(TinyFlowModelConfig(), seed=1), tmp_path / "other")
    moved = DiffusionBackend()
    moved.setup(_spec(_config(other, tmp_path), other))
    try:
        with pytest.raises(ConfigError, match=r"trained on a base with digest .* resume on the same base"):
            moved.load_checkpoint(str(ckpt))
    finally:
        moved.shutdown()


def test_diffusion_nft_trains_the_adapter_too(model_dir: Path, tmp_path: Path) -> None:
    config = _config(
        model_dir,
        tmp_path,
        "algorithm.loss=diffusion_nft",
        "algorithm.loss_options={beta: 1.0, adv_clip_max: 1.0, timesteps_per_iteration: 2}",
    )
    backend = DiffusionBackend()
    backend.setup(_spec(config, model_dir))
    try:
        frozen = {n: p.clone() for n, p in backend._peft.named_parameters() if not p.requires_grad}
        metrics = backend.train_step(_batch(model_dir))
        assert metrics["train/grad_norm"] > 0 and 0.0 <= metrics["train/optimality/mean"] <= 1.0
        after = dict(backend._peft.named_parameters())
        assert all(torch.equal(after[n], frozen[n]) for n in frozen)
        assert all(float(p.detach().abs().max()) > 0 for n, p in after.items() if ".lora_B." in n)
    finally:
        backend.shutdown()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "lora.target_modules=[q_proj]",
            r"lora.target_modules: 'q_proj' matches no module of the denoiser; its Linear and Conv2d layers are "
            r"\['conv', 'conv1', 'conv2', 'conv_in', 'conv_out', 'conv_shortcut', 'linear_1', 'linear_2', "
            r"'time_emb_proj', 'to_k', 'to_out.0', 'to_q', 'to_v'\]",
        ),
        (
            "lora.target_modules=[class_embedding]",
            r"'class_embedding' matches 'unet.class_embedding', a PromptTable; LoRA is merged into Linear and Conv2d",
        ),
        ("lora.target_modules=[norm1]", r"'norm1' matches '.*norm1', a GroupNorm"),
        ("lora.name=a.b", r"lora.name 'a.b': .* may not contain dots"),
        # The core's capability check: only the colocated hand-off reaches this engine, adapter or not.
        ("transport=broadcast", r"does not have \(it has: handoff-files\)"),
        (
            "lora={adapters: {x: {rank: 2, target_modules: [conv1]}}}",
            r"lora.adapters: the diffusion engine merges one adapter into its base weights",
        ),
    ],
)
def test_lora_sections_the_denoiser_cannot_carry_are_refused_before_anything_starts(
    model_dir: Path, tmp_path: Path, override: str, message: str
) -> None:
    from miles.driver.preflight import preflight

    with pytest.raises(ConfigError, match=message):
        preflight(_config(model_dir, tmp_path, override))
    assert not (tmp_path / "tiny_flow_grpo_lora").exists()  # nothing written, no engine started
