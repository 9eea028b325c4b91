"""LoRA on the denoiser: the trainer's side (peft) and the names both sides agree on.

The recipe's ``lora`` section is the core's (``miles.config.schema.LoraSection``: name, rank, alpha,
dropout, target_modules), read here for the denoiser instead of a language model:

* :func:`check_targets` refuses, before any weights load, target modules that match nothing the
  denoiser has, or that match a layer the engine cannot merge into (LoRA is merged into Linear and
  Conv2d weights only), and the multi-adapter form (the engine merges one adapter into its base);
* :func:`wrap` puts a peft LoRA adapter on the policy (``peft.get_peft_model``): the base frozen,
  only the adapter's ``lora_A`` / ``lora_B`` trainable;
* :func:`adapter_tensors` is the weight update's stream, the adapter only, under the names the
  engine holds it by (``unet.<module>.lora_A.<adapter>.weight``, as the token engines name theirs);
* :func:`save_adapter` / :func:`load_adapter` write and read a peft adapter directory
  (``PeftModel.from_pretrained(base, directory)`` loads it onto the base model).

The engine's side, merging on arrival, is :mod:`miles_diffusion.engine.merge`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.config.schema import LoraSection
from miles.errors import ConfigError

PEFT_PREFIX = "base_model.model."  # peft's prefix of a wrapped model's module paths
PEFT_ADAPTER = "default"  # the adapter's name inside the trainer's peft model
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGEABLE = (nn.Linear, nn.Conv2d)
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


def tensor_name(module: str, factor: str, adapter: str) -> str:
    """The engine's name of one factor: ``unet.mid_block.resnets.0.conv1.lora_A.<adapter>.weight``."""
    return f"{module}.lora_{factor}.{adapter}.weight"


def split_name(name: str) -> tuple[str, str, str | None] | None:
    """``(module, "A" or "B", adapter or None)`` of a LoRA factor's name; None for any other tensor."""
    match = _FACTOR.match(name)
    if match is None:
        return None
    return match["module"], match["factor"], match["adapter"]


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def _kind(path: str) -> str:
    """The name a target may use for a module: its last part, or the last two for a list entry (to_out.0)."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def check_targets(model: nn.Module, lora: LoraSection, where: str = "lora") -> list[str]:
    """The module paths the adapter covers; one ConfigError (what, where, what is allowed) otherwise.

    ``model`` may live on the meta device: only module types and names are read."""
    if lora.multi:
        raise ConfigError(
            f"{where}.adapters: the diffusion engine merges one adapter into its base weights, so it "
            "serves one policy; use the single form (lora.rank, lora.alpha, lora.target_modules)"
        )
    if "." in lora.name:
        raise ConfigError(
            f"{where}.name {lora.name!r}: the diffusion engine names factors <module>.lora_A.<name>.weight, "
            "so the name may not contain dots"
        )
    modules = {name: mod for name, mod in model.named_modules() if name}
    mergeable = sorted(n for n, m in modules.items() if isinstance(m, MERGEABLE))
    kinds = sorted({_kind(n) for n in mergeable})
    covered: list[str] = []
    for target in lora.target_modules:
        hits = [n for n in modules if _matches(n, target)]
        if not hits:
            raise ConfigError(
                f"{where}.target_modules: {target!r} matches no module of the denoiser; its Linear and "
                f"Conv2d layers are {kinds} (full paths such as {mergeable[0]!r})"
            )
        bad = [n for n in hits if not isinstance(modules[n], MERGEABLE)]
        if bad:
            raise ConfigError(
                f"{where}.target_modules: {target!r} matches {bad[0]!r}, a {type(modules[bad[0]]).__name__}; "
                f"LoRA is merged into Linear and Conv2d weights only ({kinds})"
            )
        grouped = [n for n in hits if isinstance(modules[n], nn.Conv2d) and modules[n].groups != 1]
        if grouped:
            raise ConfigError(
                f"{where}.target_modules: {target!r} matches grouped convolution {grouped[0]!r}"
            )
        covered.extend(hits)
    return sorted(set(covered))


def _peft_config(lora: LoraSection) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int, takes any number
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )


def wrap(model: nn.Module, lora: LoraSection, base_path: str) -> Any:
    """The policy with a peft LoRA adapter (B starts at zero: the wrapped model is the base, exactly).

    peft injects the adapter's layers into ``model`` itself; ``result.get_base_model()`` is ``model``,
    which the objectives keep training through. Only the adapter's parameters require gradients."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise ConfigError(
            "lora: the diffusion backend trains LoRA with peft, which is not installed; "
            "pip install 'peft>=0.13'"
        ) from None
    check_targets(model, lora)
    peft_model = get_peft_model(model, _peft_config(lora), adapter_name=PEFT_ADAPTER)
    # Where the exported adapter's base lives (peft would take a name_or_path the model lacks).
    peft_model.peft_config[PEFT_ADAPTER].base_model_name_or_path = os.path.abspath(base_path)
    return peft_model


def adapter_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``)."""
    from peft import get_peft_model_state_dict

    state: dict[str, torch.Tensor] = get_peft_model_state_dict(peft_model, adapter_name=PEFT_ADAPTER)
    return state


def adapter_tensors(peft_model: Any, adapter: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole current adapter under the engine's names (every update carries all of it)."""
    for name, tensor in adapter_state(peft_model).items():
        parts = split_name(name.removeprefix(PEFT_PREFIX))
        if parts is None:
            raise RuntimeError(f"peft's adapter state holds {name!r}, which is not a LoRA factor")
        module, factor, _ = parts
        yield tensor_name(module, factor, adapter), tensor.detach()


def adapter_bytes(peft_model: Any) -> int:
    """What one update moves: the bytes of every adapter tensor."""
    return sum(t.numel() * t.element_size() for t in adapter_state(peft_model).values())


def save_adapter(peft_model: Any, directory: str | Path) -> Path:
    """A peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)."""
    dest = Path(directory)
    peft_model.save_pretrained(str(dest), selected_adapters=[PEFT_ADAPTER], safe_serialization=True)
    return dest


def load_adapter(peft_model: Any, directory: str | Path) -> None:
    """Set the adapter's tensors from a directory :func:`save_adapter` wrote (one ConfigError if the
    adapter there has another shape)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    saved = load_file(str(path))
    current = adapter_state(peft_model)
    if set(saved) != set(current) or any(saved[k].shape != current[k].shape for k in saved):
        raise ConfigError(
            f"{directory}: the saved adapter's tensors differ from this run's lora section "
            f"({len(saved)} saved, {len(current)} expected); resume with the lora section it was trained with"
        )
    result = set_peft_model_state_dict(peft_model, saved, adapter_name=PEFT_ADAPTER)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ConfigError(f"{directory}: adapter tensors {unexpected[:3]} do not fit the model")
