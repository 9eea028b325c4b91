"""The diffusion weight update, full weights against a LoRA adapter merged on arrival, on CPU.

    uv run python benchmarks/diffusion_lora_update.py [--repeats 15] [--only tiny,wide,sd3,wan]

A diffusion engine process (``python -m miles_diffusion.engine``, torch on one thread, as the
recipes start it) serves a model with random weights; this process sends it weight updates
through the colocated transport (safetensors files in the hand-off directory), as the diffusion
backend does after every step, in two forms, one after the other, as a run sends them (the
adapter loaded once, then only its factors):

- ``full``: the model's whole state dict; the engine loads it;
- ``lora``: the adapter of the run recipe's lora section (``tiny`` and ``wide``: ``tiny_flow_grpo_lora``'s,
  rank 4 on conv_in, the resnet convolutions, the time projections and conv_out; ``sd3`` / ``wan``:
  ``sd3_flow_grpo_proxy_lora``'s / ``wan_flow_grpo_proxy_lora``'s, rank 4 on the transformer's
  attention projections and proj_out), its factors only, under the engine's names; the engine merges
  them into its kept base weights (``W_base + alpha/r * B A`` per module).

Per update: the bytes sent and the hand-off's wall time (``TransportStats.seconds``: writing the
files, the engine's load and commit or merge, the answer), median over ``--repeats`` updates after
one warm-up of each. And, without HTTP, what the engine itself spends (``DiffusionEngine`` in this
process, the hand-off file already written): reading the file and committing the full state dict,
or reading the factors and merging them; median over ``--repeats``. Also the engine's per-step log-probability gap after a LoRA update: its own
trajectories re-scored by the trainer's unmerged base + adapter.

Configurations: ``tiny`` (the recipes' model, 16x16, 165K parameters), ``wide`` (32x32, block
widths 64/128/256, two layers per block: about 14M parameters), and the pipeline proxies of the LoRA
run recipes: ``sd3`` (``builtin:tiny-sd3``) and ``wan`` (``builtin:tiny-wan``), where the full update
is the transformer's state dict (the text encoders and VAE never train) and the adapter wraps the
transformer, as the diffusion backend sends them.

Results go to ``benchmarks/results/diffusion_lora_update.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _bench import RESULTS_DIR, machine_info, write_result

from miles.config import load_recipe
from miles.config.schema import LoraSection
from miles.engines.client import SyncEngineClient
from miles.interfaces import EngineSpec
from miles.models.registry import resolve_model
from miles_diffusion import lora as lora_mod
from miles_diffusion.engine.client import DiffusionClient
from miles_diffusion.engine.launcher import DiffusionLauncher
from miles_diffusion.families import load_model
from miles_diffusion.model import TinyFlowModelConfig, build_tiny_model, load_pretrained, save_pretrained
from miles_diffusion.sampler import SamplerConfig, step_log_prob
from miles_transports.colocated import ColocatedTransport

CONFIGS: dict[str, TinyFlowModelConfig | str] = {
    "tiny": TinyFlowModelConfig(),
    "wide": TinyFlowModelConfig(image_size=32, block_out_channels=(64, 128, 256), layers_per_block=2),
    # a pipeline proxy: the run recipe whose model and lora section are used
    "sd3": "sd3_flow_grpo_proxy_lora",
    "wan": "wan_flow_grpo_proxy_lora",
}
LORA = LoraSection(rank=4, alpha=8, target_modules=["conv_in", "conv1", "conv2", "time_emb_proj", "conv_out"])
SAMPLER = SamplerConfig(num_steps=8, noise_level=0.7)


@dataclass
class Setup:
    """One configuration: the model directory, the adapter, how the trainer loads the model."""

    model_dir: Path
    lora: LoraSection
    prompts: tuple[str, ...] | None  # a text-prompted pipeline's prompt texts (ids index them)
    recipe: str | None

    def load(self) -> Any:
        if self.prompts is None:
            return load_pretrained(self.model_dir)
        return load_model(self.model_dir, prompts=self.prompts)


def setup(name: str, root: Path) -> Setup:
    config = CONFIGS[name]
    if isinstance(config, TinyFlowModelConfig):
        model_dir = save_pretrained(build_tiny_model(config, seed=0), root / name / "model")
        return Setup(Path(model_dir), LORA, None, None)
    recipe = load_recipe(config, [])
    assert recipe.lora is not None
    prompts = tuple(str(p) for p in recipe.rollout.options["prompts"])
    return Setup(Path(resolve_model(recipe.model.path)), recipe.lora, prompts, config)


def _perturb(peft_model: Any, seed: int) -> None:
    """New adapter values for each update (an update of the same values would prove nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


def _log_prob_gap(url: str, policy: Any, prompts: tuple[str, ...] | None) -> float:
    ids = [0, 1, 2, 3]
    texts = None if prompts is None else [prompts[i % len(prompts)] for i in ids]

    async def go() -> Any:
        client = DiffusionClient(url)
        try:
            return await client.generate_trajectories(ids, [1, 2, 3, 4], SAMPLER, texts=texts)
        finally:
            await client.aclose()

    batch = asyncio.run(go())
    with torch.no_grad():
        rescored = torch.stack(
            [
                step_log_prob(policy, batch.trajectory, i, SAMPLER.noise_level)[0]
                for i in range(SAMPLER.num_steps)
            ],
            dim=1,
        )
    return float((rescored - batch.trajectory.log_probs).abs().max())


def engine_apply(
    model_dir: Path, handoff: Path, full_model: Any, peft_model: Any, prefix: str, repeats: int
) -> dict[str, float]:
    """The engine's own share of an update, in this process: file read + commit, or file read + merge."""
    from safetensors.torch import save_file

    from miles.engines.client import HANDOFF_LOAD_FORMAT
    from miles_diffusion.engine.server import (
        DiffusionEngine,
        LoadLoraBody,
        UnloadLoraBody,
        UpdateFromTensorBody,
    )

    handoff.mkdir(parents=True, exist_ok=True)
    engine = DiffusionEngine(str(model_dir), handoff_dir=str(handoff))
    full = {k: v.contiguous() for k, v in full_model.state_dict().items()}
    save_file(full, str(handoff / "full.safetensors"))
    save_file(
        {k: v.contiguous() for k, v in lora_mod.adapter_tensors(peft_model, "policy", prefix)},
        str(handoff / "lora.safetensors"),
    )
    adapter_dir = str(lora_mod.save_adapter(peft_model, handoff.parent / "apply-initial"))
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for i in range(repeats + 1):
        for kind in ("full", "lora"):
            if kind == "lora":
                engine.load_lora(LoadLoraBody(lora_name="policy", lora_path=adapter_dir))
            body = UpdateFromTensorBody(
                serialized_named_tensors=[f"{kind}.safetensors"],
                load_format=HANDOFF_LOAD_FORMAT,
                weight_version=str(i + 1),
                bucket_index=0,
            )
            start = time.perf_counter()
            engine.update_bucket(body)
            if i:
                times[kind].append(time.perf_counter() - start)
            if kind == "lora":
                engine.unload_lora(UnloadLoraBody(lora_name="policy"))
    return {k: statistics.median(v) for k, v in times.items()}


def run_config(name: str, repeats: int, root: Path) -> dict[str, Any]:
    cfg = setup(name, root)
    model_dir = cfg.model_dir
    handoff = root / name / "handoff"
    launcher = DiffusionLauncher()
    options = {"handoff_dir": str(handoff), "torch_threads": 1, "deterministic": True}
    [url] = launcher.launch(
        [EngineSpec(model_path=str(model_dir), options=options)], str(root / name / "logs")
    )
    try:
        full_model = cfg.load()
        policy = cfg.load()  # the trainer's model; peft injects the adapter into it (or its transformer)
        peft_model = lora_mod.wrap(policy, cfg.lora, str(model_dir))
        prefix = lora_mod.adapter_prefix(policy)
        transport = ColocatedTransport(handoff_dir=str(handoff))
        transport.connect([url], rank=0, world_size=1, device="cpu")
        times: dict[str, list[float]] = {"full": [], "lora": []}
        sizes: dict[str, int] = {}
        version = 0
        try:
            # As in a run: a run of full-weight updates, then (the adapter loaded once, as the backend's
            # setup does) a run of adapter updates, each with new values.
            for i in range(repeats + 1):
                version += 1
                with torch.no_grad():
                    stats = transport.send(iter(full_model.state_dict().items()), version)
                sizes["full"] = stats.bytes_sent
                if i:
                    times["full"].append(stats.seconds)
            with SyncEngineClient(url) as client:
                client.load_lora_adapter(
                    "policy", str(lora_mod.save_adapter(peft_model, root / name / "initial"))
                )
            for i in range(repeats + 1):
                _perturb(peft_model, i)
                version += 1
                with torch.no_grad():
                    stats = transport.send(lora_mod.adapter_tensors(peft_model, "policy", prefix), version)
                sizes["lora"] = stats.bytes_sent
                if i:
                    times["lora"].append(stats.seconds)
            gap = _log_prob_gap(url, policy, cfg.prompts)
        finally:
            transport.close()
    finally:
        launcher.shutdown()
    applied = engine_apply(model_dir, root / name / "apply", full_model, peft_model, prefix, repeats)
    # the parameters of what trains (the tiny UNet, or a pipeline's transformer); the full update is
    # its state dict (SD3's also holds its positional-embedding buffer)
    params = sum(p.numel() for p in lora_mod.adapter_root(full_model)[0].parameters())
    return {
        "recipe": cfg.recipe,  # the run recipe whose model and lora section this is (None: the tiny UNet)
        "lora": cfg.lora.model_dump(include={"rank", "alpha", "target_modules"}),
        "parameters": params,
        "adapter_parameters": sizes["lora"] // 4,
        "bytes": sizes,
        "bytes_ratio": sizes["full"] / sizes["lora"],
        "seconds_median": {k: statistics.median(v) for k, v in times.items()},
        "seconds_all": times,
        "time_ratio": statistics.median(times["full"]) / statistics.median(times["lora"]),
        "lora_log_prob_gap_max": gap,
        "engine_apply_seconds_median": applied,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default=",".join(CONFIGS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"machine": machine_info(), "repeats": args.repeats, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="miles-lora-bench-") as tmp:
        for name in args.only.split(","):
            out = run_config(name, args.repeats, Path(tmp))
            result["configs"][name] = out
            med = out["seconds_median"]
            print(
                f"{name}: {out['parameters']:,} parameters; full {out['bytes']['full']:,} B in {med['full'] * 1e3:.1f} ms, "
                f"lora {out['bytes']['lora']:,} B in {med['lora'] * 1e3:.1f} ms "
                f"({out['bytes_ratio']:.1f}x fewer bytes, {out['time_ratio']:.1f}x faster); "
                f"log-prob gap after the LoRA update {out['lora_log_prob_gap_max']:.2e}; engine's own apply: "
                f"full {out['engine_apply_seconds_median']['full'] * 1e3:.1f} ms, "
                f"lora {out['engine_apply_seconds_median']['lora'] * 1e3:.1f} ms"
            )
    print(write_result(RESULTS_DIR / "diffusion_lora_update.json", result))


if __name__ == "__main__":
    main()
