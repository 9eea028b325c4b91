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

The adapter's root (:func:`adapter_root`) is the module peft wraps: the whole tiny UNet model, or a
pipeline family's transformer (SD3, Wan: the only part that trains), so that a pipeline's exported
adapter loads onto the bare transformer (``PeftModel.from_pretrained(transformer, directory)``).
Target modules are names under the root; the engine names factors by their path in the whole model,
the root's prefix (``transformer.``) before the module.

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


TRANSFORMER_PREFIX = "transformer."  # a pipeline family's adapter root in the whole model


def adapter_root(model: nn.Module) -> tuple[nn.Module, str]:
    """The module the adapter wraps and its path prefix in ``model``: a pipeline family's transformer
    (``transformer.``), or the model itself (no prefix)."""
    from miles_diffusion.pipeline_model import PipelineFlowModel

    if isinstance(model, PipelineFlowModel):
        if getattr(model, "transformer_2", None) is not None:
            from miles_diffusion.wan import two_expert_refusal

            raise ValueError(two_expert_refusal(type(model).__name__, "LoRA"))
        return model.transformer, TRANSFORMER_PREFIX
    return model, ""


def adapter_prefix(model: nn.Module) -> str:
    """Where the adapter's module paths sit in ``model`` (what the engine puts before them)."""
    return adapter_root(model)[1]


def root_on_meta(directory: str | Path) -> nn.Module:
    """The adapter's root of the model in ``directory`` built on the meta device from its config, no
    weights read: the tiny UNet model from ``config.json``, or a pipeline's transformer from the class
    ``model_index.json`` names and ``transformer/config.json`` (what :func:`check_targets` reads)."""
    import json

    root = Path(directory)
    index = root / "model_index.json"
    if index.is_file():
        entry = json.loads(index.read_text()).get(TRANSFORMER_PREFIX.rstrip("."))
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers"):
            raise ConfigError(
                f"{directory}: model_index.json names no diffusers transformer for lora to adapt ({entry!r})"
            )
        import diffusers

        cls = getattr(diffusers, str(entry[1]), None)
        if cls is None:
            raise ConfigError(f"{directory}: diffusers has no transformer class {entry[1]!r}")
        config = cls.load_config(str(root / TRANSFORMER_PREFIX.rstrip(".")))
        with torch.device("meta"):
            module: nn.Module = cls.from_config(config)
        return module
    from miles_diffusion.model import FlowModel, read_model_config

    try:
        shape = read_model_config(root)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    with torch.device("meta"):
        return FlowModel(shape)


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

    peft injects the adapter's layers into the adapter's root (:func:`adapter_root`: ``model`` or its
    transformer) itself; ``result.get_base_model()`` is that root, and ``model`` keeps training through
    it. Only the adapter's parameters require gradients (a pipeline's frozen parts never did)."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise ConfigError(
            "lora: the diffusion backend trains LoRA with peft, which is not installed; "
            "pip install 'peft>=0.13'"
        ) from None
    root, prefix = adapter_root(model)
    check_targets(root, lora)
    peft_model = get_peft_model(root, _peft_config(lora), adapter_name=PEFT_ADAPTER)
    # Where the exported adapter's base lives (peft would take a name_or_path the model lacks): the
    # model directory, or a pipeline's transformer folder.
    base = os.path.join(base_path, prefix.rstrip(".")) if prefix else base_path
    peft_model.peft_config[PEFT_ADAPTER].base_model_name_or_path = os.path.abspath(base)
    return peft_model


def adapter_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``)."""
    from peft import get_peft_model_state_dict

    state: dict[str, torch.Tensor] = get_peft_model_state_dict(peft_model, adapter_name=PEFT_ADAPTER)
    return state


def adapter_tensors(peft_model: Any, adapter: str, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The whole current adapter under the engine's names (every update carries all of it); ``prefix``
    is the adapter root's path in the engine's model (:func:`adapter_prefix`)."""
    for name, tensor in adapter_state(peft_model).items():
        parts = split_name(name.removeprefix(PEFT_PREFIX))
        if parts is None:
            raise RuntimeError(f"peft's adapter state holds {name!r}, which is not a LoRA factor")
        module, factor, _ = parts
        yield tensor_name(prefix + module, factor, adapter), tensor.detach()


def adapter_bytes(peft_model: Any) -> int:
    """What one update moves: the bytes of every adapter tensor."""
    return sum(t.numel() * t.element_size() for t in adapter_state(peft_model).values())


def save_adapter(peft_model: Any, directory: str | Path) -> Path:
    """A peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)."""
    dest = Path(directory)
    peft_model.save_pretrained(str(dest), selected_adapters=[PEFT_ADAPTER], safe_serialization=True)
    return dest


DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"  # the file diffusers' load_lora_weights reads
DIFFUSERS_METADATA = "lora_adapter_metadata"  # its safetensors metadata key for the adapter's config


def save_for_diffusers(peft_model: Any, directory: str | Path, prefix: str) -> Path:
    """Beside the peft files, the same factors in the layout a diffusers pipeline's
    ``load_lora_weights(directory)`` reads: ``<component>.<module>.lora_A.weight`` (the component is
    the adapter root's name, ``transformer``), rank, alpha and modules as the file's metadata under
    ``<component>.``-prefixed keys (so the pipeline builds the adapter's scale, alpha/r, from them)."""
    import json

    from safetensors.torch import save_file

    state = adapter_state(peft_model)
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for name, tensor in state.items():
        parts = split_name(name.removeprefix(PEFT_PREFIX))
        if parts is None:
            raise RuntimeError(f"peft's adapter state holds {name!r}, which is not a LoRA factor")
        module, factor, _ = parts
        modules.add(module)
        tensors[f"{prefix}{module}.lora_{factor}.weight"] = tensor.detach().contiguous()
    config = peft_model.peft_config[PEFT_ADAPTER]
    settings = {"r": config.r, "lora_alpha": config.lora_alpha, "target_modules": sorted(modules)}
    metadata = {DIFFUSERS_METADATA: json.dumps({prefix + k: v for k, v in settings.items()}), "format": "pt"}
    dest = Path(directory) / DIFFUSERS_WEIGHTS
    save_file(tensors, str(dest), metadata=metadata)
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
