"""LoRA on the FSDP backend: a ``peft`` adapter over the frozen policy.

* :func:`check_targets` refuses target modules the model does not have (before any rank starts:
  the model is built on the meta device, so nothing is loaded);
* :func:`wrap` turns the loaded policy into a ``peft`` model whose only trainable parameters are
  the adapters' (multi-LoRA: one peft adapter per ``lora.adapters`` entry, under its own name);
* :func:`activate` chooses the adapter the next forward passes use (multi-LoRA trains each
  adapter's rows of a batch with only that adapter active);
* :func:`iter_adapter_tensors` is the weight update's stream: only the adapters, under the names an
  engine holds them by (``<module>.lora_A.<adapter>.weight``, see ``miles.engines.embedded.lora``);
* :func:`save_adapter` writes a ``peft`` adapter directory (``PeftModel.from_pretrained`` loads it);
* :func:`base_reference` names the base a checkpoint was trained on (path and content digest), so
  a resume on another base is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from miles.config.schema import LoraSection, LoraShape
from miles.errors import ConfigError, ModelError
from miles.lora import (
    check_same_base,
    matches,
    section,
)

PEFT_ADAPTER = "default"  # the adapter name inside the trainer's peft model
_PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"


def linear_module_names(model: nn.Module) -> list[str]:
    """Every ``nn.Linear`` in the model, by its module path."""
    return [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and name]


def check_targets(model_path: str, lora: LoraShape, field: str = "lora.target_modules") -> list[str]:
    """The module paths the adapter covers; unknown targets are refused with the model's linear names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = linear_module_names(model)
    unknown = [t for t in lora.target_modules if not any(matches(n, t) for n in linears)]
    if unknown:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ConfigError(
            f"{field} {unknown} match no linear module of {type(model).__name__}; its linear "
            f"modules are {kinds} (full paths such as {linears[0]!r})"
        )
    return [n for n in linears if any(matches(n, t) for t in lora.target_modules)]


def peft_names(lora: LoraSection) -> dict[str, str]:
    """Each adapter's name on the engines -> its name inside the trainer's peft model.

    The single form keeps peft's ``default`` (its checkpoints name it so); multi-LoRA uses the names.
    """
    if lora.multi:
        return {name: name for name in lora.named()}
    return {lora.name: PEFT_ADAPTER}


def _peft_config(shape: LoraShape) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=shape.rank,
        lora_alpha=shape.alpha,  # type: ignore[arg-type]  # peft annotates int, takes any number
        lora_dropout=shape.dropout,
        target_modules=list(shape.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: nn.Module, lora: LoraSection) -> nn.Module:
    """The policy as a ``peft`` LoRA model: base frozen, every adapter trainable (B starts at zero)."""
    from peft import get_peft_model

    shapes = lora.named()
    names = peft_names(lora)
    first, *rest = shapes
    peft_model = get_peft_model(model, _peft_config(shapes[first]), adapter_name=names[first])
    for name in rest:
        peft_model.add_adapter(names[name], _peft_config(shapes[name]))
    # peft leaves only the active adapter trainable; every adapter trains here (each on its own rows).
    for param_name, param in peft_model.named_parameters():
        if ".lora_" in param_name:
            param.requires_grad_(True)
    return peft_model


def activate(model: nn.Module, peft_adapter: str) -> None:
    """The adapter the next forward passes apply (multi-LoRA); trainability is left as it is.

    peft's ``set_adapter`` would also freeze the other adapters, which must keep their gradients'
    place under FSDP, so only each LoRA layer's active adapter is set.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module._active_adapter = [peft_adapter]


def engine_name(peft_name: str, adapter: str, peft_adapter: str = PEFT_ADAPTER) -> str:
    """``base_model.model.model.layers.0.q_proj.lora_A.default.weight`` -> ``model.layers.0.q_proj.lora_A.<adapter>.weight``."""
    return _renamed(peft_name.removeprefix(_PEFT_PREFIX), peft_adapter, f".{adapter}.")


def adapter_parameters(model: nn.Module, peft_adapter: str | None = None) -> list[tuple[str, nn.Parameter]]:
    """The adapters' parameters (``peft_adapter``: only that one's)."""
    return [
        (n, p)
        for n, p in model.named_parameters()
        if p.requires_grad and ".lora_" in n and (peft_adapter is None or _of(n, peft_adapter))
    ]


def _of(param_name: str, peft_adapter: str) -> bool:
    return any(f".lora_{f}.{peft_adapter}." in param_name for f in "AB")


def _renamed(param_name: str, peft_adapter: str, to: str) -> str:
    """``...lora_A.<peft_adapter>.weight`` -> ``...lora_A<to>weight`` (``to``: ``.<name>.`` or ``.``)."""
    for f in "AB":
        param_name = param_name.replace(f".lora_{f}.{peft_adapter}.", f".lora_{f}{to}")
    return param_name


def iter_adapter_tensors(model: nn.Module, adapters: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of ``adapters`` (engine name -> peft name) under engine names.

    A collective: every rank drains it in order.
    """
    for adapter, peft_adapter in adapters.items():
        for name, param in adapter_parameters(model, peft_adapter):
            t = param.detach()
            yield engine_name(name, adapter, peft_adapter), t.full_tensor() if isinstance(t, DTensor) else t


def save_adapter(
    directory: str,
    model: nn.Module,
    base_path: str,
    write: bool,
    peft_adapter: str = PEFT_ADAPTER,
) -> None:
    """Write one adapter as a peft directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    A collective (the tensors are gathered on every rank); only ``write`` (rank 0) writes.
    """
    from safetensors.torch import save_file

    tensors = {
        _renamed(name.removeprefix(_PEFT_PREFIX), peft_adapter, "."): t.detach().cpu().contiguous()
        for name, t in (
            (n, p.full_tensor() if isinstance(p, DTensor) else p)
            for n, p in adapter_parameters(model, peft_adapter)
        )
    }
    if not write:
        return
    os.makedirs(directory, exist_ok=True)
    peft_config: Any = model.peft_config[peft_adapter]  # type: ignore[index]
    config = peft_config.to_dict()
    config["base_model_name_or_path"] = os.path.abspath(base_path)
    config["target_modules"] = sorted(config["target_modules"])
    config["inference_mode"] = True
    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, default=str)
    save_file(
        {f"{_PEFT_PREFIX}{k}": v for k, v in tensors.items()},
        os.path.join(directory, "adapter_model.safetensors"),
    )


def adapter_dir(directory: str, lora: LoraSection, adapter: str) -> str:
    """Where an export holds ``adapter``: the directory itself (single form) or ``<directory>/<adapter>``."""
    return os.path.join(directory, adapter) if lora.multi else directory


def check_checkpoint(directory: str, spec: Any) -> None:
    """Refuse a resume that mixes LoRA and full checkpoints, or a LoRA checkpoint of another base."""
    from miles_fsdp.checkpoint import STATE_FILE

    with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as f:
        saved = json.load(f).get("lora")
    current = section(spec.config)
    if current is None:
        if saved is not None:
            raise ModelError(
                f"checkpoint {directory} holds a LoRA adapter ({saved.get('name')!r}); resume it with its "
                "lora section"
            )
        return
    check_same_base(None if saved is None else saved.get("base"), spec.model_path, directory)
    assert saved is not None
    have, want = sorted(saved.get("adapters", [saved.get("name")])), sorted(current.named())
    if have != want:
        raise ModelError(
            f"checkpoint {directory} holds LoRA adapters {have}, but this run trains {want}; resume with "
            "the same adapters"
        )
