"""LoRA against full-parameter training on CPU: same model, same batch, same run.

    uv run python benchmarks/lora_vs_full.py [--steps 5] [--shapes tiny mid]

For each model shape, one embedded engine (a real process) serves the base, and the FSDP backend
(one rank, gloo) trains in two configurations one after the other on the same batch: full
parameters, then a LoRA adapter (rank 16 on every attention and MLP projection). After every
optimizer step the new weights go to the engine through the broadcast transport: every tensor
for full training, only the adapter's for LoRA. Reported per configuration: median seconds per
train step, optimizer-state bytes (AdamW moments, measured on the rank), and median bytes and
seconds per weight update; then LoRA / full ratios. The first step of each configuration is a
warm-up and is not counted. Results go to ``benchmarks/results/lora_vs_full.json``.

Shapes: ``tiny`` is the built-in tiny Qwen3 of the default recipe; ``mid`` a random Qwen3 shape
with hidden 512, 8 layers, vocabulary 8192 (about 38M parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import RESULTS_DIR, machine_info

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_mid(path: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def make_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> Any:
    from miles.types import Prompt, Sample, TrainBatch

    rng = random.Random(seed)
    samples, advantages = [], []
    for i in range(n):
        samples.append(
            Sample(
                prompt=Prompt(index=i, prompt=f"p{i}"),
                prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                response_ids=[rng.randrange(vocab) for _ in range(response_len)],
                rollout_logprobs=[-1.0] * response_len,
                loss_mask=[1] * response_len,
                weight_versions=[0] * response_len,
            )
        )
        advantages.append([rng.choice([-1.0, 1.0])] * response_len)
    return TrainBatch(samples=samples, advantages=advantages, step=0)


def spec_for(model_path: str, url: str, work: Path, lora: bool, micro_batch: int) -> Any:
    from miles.config import load_recipe
    from miles.interfaces import BackendSpec

    overrides = [f"model.path={model_path}", f"run.output_dir={work}", "run.name=bench"]
    if lora:
        overrides += ["lora.rank=16", "lora.alpha=32", f"lora.target_modules={json.dumps(TARGETS)}"]
    config = load_recipe("default", overrides).model_dump(mode="json")
    return BackendSpec(
        model_path=model_path,
        loss="ppo_clip",
        correction=None,
        transport="broadcast",
        engine_urls=[url],
        temperature=1.0,
        options={
            "train": {"lr": 1e-4, "micro_batch_size": micro_batch, "grad_clip": 1.0},
            "fsdp": {"num_ranks": 1, "torch_threads": 1, "startup_timeout_s": 300, "command_timeout_s": 600},
        },
        transport_options={"bucket_mb": 64},
        config=config,
    )


def measure(spec: Any, batch: Any, steps: int) -> dict[str, Any]:
    from miles_fsdp.backend import FSDPBackend

    backend = FSDPBackend()
    backend.setup(spec)
    try:
        step_s, update_s, update_bytes = [], [], []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            backend.train_step(batch)
            elapsed = time.perf_counter() - t0
            stats = backend.update_weights(i + 1)
            if i == 0:
                continue  # warm-up
            step_s.append(elapsed)
            update_s.append(stats.seconds)
            update_bytes.append(stats.bytes_sent)
        return {
            "train_step_s": statistics.median(step_s),
            "train_step_s_all": step_s,
            "optimizer_state_bytes": backend.optimizer_state_bytes(),
            "update_bytes": statistics.median(update_bytes),
            "update_s": statistics.median(update_s),
            "update_s_all": update_s,
        }
    finally:
        backend.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=5, help="measured steps per configuration (after one warm-up)"
    )
    parser.add_argument("--shapes", nargs="+", default=["tiny", "mid"], choices=["tiny", "mid"])
    parser.add_argument("--batch", type=int, default=16, help="samples per step")
    args = parser.parse_args()

    from miles.engines.launchers import EmbeddedLauncher
    from miles.interfaces import EngineSpec
    from miles.models.registry import resolve_model

    results: dict[str, Any] = {"machine": machine_info(), "steps": args.steps, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="miles-lora-bench-") as tmp:
        work = Path(tmp)
        for shape in args.shapes:
            if shape == "tiny":
                model_path, vocab, plen, rlen = resolve_model("builtin:tiny-qwen3"), 0, 8, 8
            else:
                model_path, vocab, plen, rlen = str(build_mid(work / "mid")), 8192, 64, 64
            from transformers import AutoConfig

            vocab = int(AutoConfig.from_pretrained(model_path).vocab_size)
            batch = make_batch(args.batch, plen, rlen, vocab)
            launcher = EmbeddedLauncher(startup_timeout_s=300)
            options = {"torch_threads": 1, "dtype": "float32", "max_batch_size": 4}
            [url] = launcher.launch(
                [EngineSpec(model_path=model_path, options=options)], str(work / f"logs-{shape}")
            )
            try:
                row: dict[str, Any] = {"model": model_path, "batch": [args.batch, plen, rlen]}
                for name, lora in (("full", False), ("lora", True)):
                    spec = spec_for(model_path, url, work / f"{shape}-{name}", lora, micro_batch=8)
                    row[name] = measure(spec, batch, args.steps)
                    print(
                        shape,
                        name,
                        {k: v for k, v in row[name].items() if not k.endswith("_all")},
                        flush=True,
                    )
            finally:
                launcher.shutdown()
            full, lo = row["full"], row["lora"]
            row["ratios"] = {
                "train_step_s": lo["train_step_s"] / full["train_step_s"],
                "optimizer_state_bytes": lo["optimizer_state_bytes"] / full["optimizer_state_bytes"],
                "update_bytes": lo["update_bytes"] / full["update_bytes"],
                "update_s": lo["update_s"] / full["update_s"],
            }
            print(shape, "lora/full", {k: round(v, 4) for k, v in row["ratios"].items()}, flush=True)
            results["shapes"][shape] = row
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / "lora_vs_full.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
