"""Helpers for the LoRA tests: peft adapters with non-zero factors, merged references, submits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_adapter(
    base: Path, dest: Path, *, seed: int, rank: int, targets: list[str], alpha: float = 8.0
) -> Path:
    """A peft LoRA adapter of ``base`` saved with peft itself; both factors random (B is not zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, task_type="CAUSAL_LM")
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(dest)
    # With lm_head among the targets peft also saves the base's lm_head weight; the trainer's export
    # (and so what the engines load) holds the lora_A / lora_B tensors only.
    from safetensors.torch import load_file, save_file

    path = dest / "adapter_model.safetensors"
    saved = load_file(str(path))
    if any("lora_" not in k for k in saved):
        save_file({k: v for k, v in saved.items() if "lora_" in k}, str(path))
    return dest


def merged_model(base: Path, adapter: Path | None) -> Any:
    """The reference: the base with the adapter merged into its weights by peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def forward_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(output)]


def submit_all(
    engine: Any, jobs: list[tuple[list[int], str | None]], *, max_new_tokens: int = 6
) -> list[Any]:
    """Submit every (prompt, adapter) at once (greedy, log-probs) and wait for every answer."""
    from engine.helpers import generate_in_process

    reqs = generate_in_process(
        engine,
        [prompt for prompt, _ in jobs],
        max_new_tokens=max_new_tokens,
        timeout=60,
        per_prompt=[{"lora": lora} for _, lora in jobs],
    )
    for r in reqs:
        assert r.error is None, r.error
    return reqs
