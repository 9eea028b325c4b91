"""LoRA through a real engine process: the trainer's adapter, after a training step, merged by the
engine on arrival, samples trajectories whose every step's log-probability the trainer (base +
unmerged peft adapter) re-scores to within 1e-5 in float32.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.config.schema import LoraSection
from miles.engines.client import SyncEngineClient
from miles.interfaces import EngineSpec
from miles_diffusion import lora as lora_mod
from miles_diffusion.engine.client import DiffusionClient
from miles_diffusion.engine.launcher import DiffusionLauncher
from miles_diffusion.flow_grpo import FlowGRPOConfig
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, load_pretrained, save_pretrained
from miles_diffusion.objectives import TrainerConfig
from miles_diffusion.sampler import SamplerConfig, step_log_prob
from miles_diffusion.trainer import FlowGRPOTrainer
from miles_transports.colocated import ColocatedTransport

SAMPLER = SamplerConfig(num_steps=4, noise_level=0.7)
LORA = LoraSection(name="policy", rank=4, alpha=8, target_modules=["conv1", "conv2", "time_emb_proj"])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    root = tmp_path_factory.mktemp("diffusion-lora-engine")
    model_dir = save_pretrained(build_tiny_model(TinyFlowModelConfig(), seed=0), root / "model")
    handoff = root / "handoff"
    launcher = DiffusionLauncher()
    options = {"handoff_dir": str(handoff), "torch_threads": 1, "deterministic": True, "max_batch_size": 8}
    try:
        [url] = launcher.launch([EngineSpec(model_path=str(model_dir), options=options)], str(root / "logs"))
        yield url, model_dir, root
    finally:
        launcher.shutdown()


def _generate(url: str, prompts: list[int], seeds: list[int]):
    async def go():
        client = DiffusionClient(url)
        try:
            return await client.generate_trajectories(prompts, seeds, SAMPLER)
        finally:
            await client.aclose()

    return asyncio.run(go())


def _rescored(model, batch) -> torch.Tensor:
    with torch.no_grad():
        steps = [
            step_log_prob(model, batch.trajectory, i, SAMPLER.noise_level)[0]
            for i in range(SAMPLER.num_steps)
        ]
    return torch.stack(steps, dim=1)


def test_the_engine_samples_with_the_trained_adapter_merged(engine) -> None:
    url, model_dir, root = engine
    peft_model = lora_mod.wrap(load_pretrained(model_dir), LORA, str(model_dir))
    policy = peft_model.get_base_model()  # the FlowModel with the adapter's layers injected
    with SyncEngineClient(url) as client:
        client.load_lora_adapter(LORA.name, str(lora_mod.save_adapter(peft_model, root / "initial")))
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["lora_adapter"]["name"] == "policy" and info["lora_adapter"]["merged"] is True

    prompts, seeds = [0, 0, 1, 1, 2, 2, 3, 3], [21, 22, 23, 24, 25, 26, 27, 28]
    first = _generate(url, prompts, seeds)
    assert first.weight_version == 0
    assert torch.equal(_rescored(policy, first), first.trajectory.log_probs)  # B = 0: exactly the base

    # One Flow-GRPO step on the engine's trajectories (advantages of both signs in every group).
    trainer = FlowGRPOTrainer(
        policy, FlowGRPOConfig(clip_range=1.0), TrainerConfig(lr=0.05), SAMPLER.noise_level
    )
    stats = trainer.train_step(
        first.trajectory, torch.tensor([1.0, -1.0] * 4), list(range(SAMPLER.num_steps))
    )
    assert stats["grad_norm"] > 0
    assert all(float(p.detach().abs().max()) > 0 for n, p in peft_model.named_parameters() if ".lora_B." in n)

    transport = ColocatedTransport(handoff_dir=str(root / "handoff"))
    transport.carry_adapter(LORA.name)
    transport.connect([url], rank=0, world_size=1, device="cpu")
    try:
        with torch.no_grad():
            sent = transport.send(lora_mod.adapter_tensors(peft_model, LORA.name), 1)
    finally:
        transport.close()
    assert sent.bytes_sent == lora_mod.adapter_bytes(peft_model) == 89600  # the adapter, not the 659 KB model

    second = _generate(url, prompts, seeds)
    assert second.weight_version == 1
    assert not torch.equal(
        second.trajectory.log_probs, first.trajectory.log_probs
    )  # the adapter changed sampling
    gap = (_rescored(policy, second) - second.trajectory.log_probs).abs().max()
    assert gap < 1e-5, f"engine (merged) vs trainer (base + adapter) log-prob gap {gap}"

    # The fleet's catch-up of a restarted engine (miles.driver.fleet): the version, then the exported
    # adapter by name. From the base (unloaded here, as a restarted engine starts), it serves the trainer's.
    with SyncEngineClient(url) as client:
        client.unload_lora_adapter(LORA.name)
        assert torch.equal(_generate(url, prompts, seeds).trajectory.log_probs, first.trajectory.log_probs)
        client.update_weight_version(7)
        client.load_lora_adapter(LORA.name, str(lora_mod.save_adapter(peft_model, root / "export")))
    caught_up = _generate(url, prompts, seeds)
    assert caught_up.weight_version == 7
    assert torch.equal(caught_up.trajectory.log_probs, second.trajectory.log_probs)
