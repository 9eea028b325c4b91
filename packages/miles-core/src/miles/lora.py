"""What every backend that trains a LoRA adapter shares: the run's ``lora`` section, target matching, and
the base model an adapter checkpoint belongs to (so a resume on another base is refused).

The adapters themselves are each backend's (peft modules on FSDP, adapter-carrying parallel linears on
Megatron); this module holds only the rules that must read the same on all of them.
"""

from __future__ import annotations

import os
from typing import Any

from miles.config.schema import LoraSection
from miles.errors import ModelError

# Transports whose engines can receive an adapter by name (the others say so with ``carries_adapters``).
CARRYING_TRANSPORTS = ("broadcast", "colocated")


def section(config: dict[str, Any] | None) -> LoraSection | None:
    """The run's ``lora`` section from its config as JSON data (None: full-parameter training)."""
    raw = (config or {}).get("lora")
    return None if raw is None else LoraSection.model_validate(raw)


def matches(module: str, target: str) -> bool:
    """Whether ``lora.target_modules`` entry ``target`` names ``module`` (the whole path or its last parts)."""
    return module == target or module.endswith("." + target)


def transport_refusal(transport: str) -> str:
    """Why a LoRA run cannot use ``transport``, one sentence."""
    return (
        f"lora: transport {transport!r} cannot carry a LoRA adapter (p2p and disk-delta move whole base "
        f"tensors); use one of {list(CARRYING_TRANSPORTS)}"
    )


def base_reference(model_path: str) -> dict[str, str]:
    """The base an adapter checkpoint belongs to: its path and an xxh3-128 digest of its config and weights."""
    import xxhash

    h = xxhash.xxh3_128()
    names = sorted(
        n for n in os.listdir(model_path) if n == "config.json" or n.endswith((".safetensors", ".bin"))
    )
    for name in names:
        h.update(name.encode())
        with open(os.path.join(model_path, name), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return {"path": os.path.abspath(model_path), "digest": h.hexdigest()}


def check_same_base(saved: dict[str, str] | None, model_path: str, checkpoint: str) -> None:
    """Refuse resuming an adapter checkpoint whose recorded base (``saved``) is not ``model_path``'s, or a
    checkpoint that records none (written by a full-parameter run)."""
    if saved is None:
        raise ModelError(
            f"checkpoint {checkpoint} holds no LoRA adapter (it was written by a full-parameter run); "
            "resume it without a lora section"
        )
    current = base_reference(model_path)
    if saved.get("digest") != current["digest"]:
        raise ModelError(
            f"checkpoint {checkpoint} holds a LoRA adapter trained on base {saved.get('path')!r} "
            f"(digest {saved.get('digest')}), but this run's base {current['path']!r} has digest "
            f"{current['digest']}; resume on the same base model"
        )
