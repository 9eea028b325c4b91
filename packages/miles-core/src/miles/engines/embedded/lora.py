"""LoRA adapters served by name on top of the resident base, never merged into it.

``/load_lora_adapter {lora_name, lora_path}`` reads a ``peft`` adapter directory
(``adapter_config.json`` and ``adapter_model.safetensors``) and keeps, per target linear, the two
factors ``A [r, in]`` and ``B [out, r]`` and the scale (``alpha / r``, or ``alpha / sqrt(r)`` with
rsLoRA). A forward hook on each target linear (a hook torch provides; the HF module is not
replaced) adds ``scale * B(A(x))`` to the rows of the batch whose request named that adapter, so
one batch may mix requests of several adapters and of the base. The runner says which adapter
each row uses with :meth:`LoraServing.rows` around its forward.

Adapter tensors are also named weights of the engine, ``<module>.lora_A.<adapter>.weight`` and
``<module>.lora_B.<adapter>.weight`` (the trainer sends them under these names): they are added to
the :class:`~miles.engines.embedded.weights.WeightUpdater`'s targets, so every weight-update path
(broadcast, hand-off files) and the weight checker handle them like any tensor. Each adapter keeps
the weight version of the last update that wrote its tensors.

This class serves the DynamicCache path (one hook per adapter and module, rows picked with
``index_add``). The paged path serves adapters from preallocated slots instead, one masked pair of
GEMMs per module for every adapter of a step, with static shapes for its CUDA graphs:
:class:`miles.engines.embedded.paged.lora.PagedLoraServing`, a subclass that keeps the loading,
checks, names and versions here.

Not here: DoRA, bias training, ``modules_to_save``, embedding adapters (refused at load).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."


class LoraError(ValueError):
    """An adapter could not be loaded or used; the engine is unchanged."""


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scale: float
    # module path -> (A [r, in], B [out, r]), in the model's dtype and device
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    version: str = "0"

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for module, (a, b) in self.factors.items():
            out[tensor_name(module, "A", self.name)] = a
            out[tensor_name(module, "B", self.name)] = b
        return out


def tensor_name(module: str, factor: str, adapter: str) -> str:
    """The engine's name of one factor: ``model.layers.0.self_attn.q_proj.lora_A.<adapter>.weight``."""
    return f"{module}.lora_{factor}.{adapter}.weight"


def adapter_scale(config: dict[str, Any], path: str) -> tuple[int, float]:
    """``(rank, scale)`` of a peft adapter config: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    rank = int(config.get("r", 0))
    if rank <= 0:
        raise LoraError(f"adapter {path!r} has rank r={rank}; it must be > 0")
    alpha = float(config.get("lora_alpha", rank))
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_peft_dir(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config, {module path: {"A": tensor, "B": tensor}})`` of a peft adapter directory."""
    from safetensors.torch import load_file

    root = Path(path)
    config_path = root / "adapter_config.json"
    weights_path = root / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise LoraError(
            f"{path!r} is not a peft adapter directory (needs adapter_config.json and adapter_model.safetensors)"
        )
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"adapter {path!r} is a {config.get('peft_type')} adapter; only LORA is served")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(key) == bad:
            raise LoraError(f"adapter {path!r} sets {key}; not supported by the embedded engine")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise LoraError(
            f"adapter {path!r} trains biases or modules_to_save; not supported by the embedded engine"
        )
    return config, load_file(str(weights_path))


class LoraServing:
    """The adapters an engine serves, and the hooks that apply them per row."""

    def __init__(self, model: nn.Module, updater: Any, step_lock: Any) -> None:
        self.model = model
        self.updater = updater
        self.step_lock = step_lock
        self.adapters: dict[str, Adapter] = {}
        self.linears = {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}
        self._hooks: dict[str, Any] = {}
        # Set around one forward by the scheduler thread: [(adapter, row indices or None for all rows)].
        self._active: list[tuple[Adapter, torch.Tensor | None]] = []
        self._lock = threading.Lock()
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device

    # ---------------------------------------------------------------- loading

    def load(self, name: str, path: str) -> Adapter:
        """Read the peft directory ``path`` and serve it as ``name`` (replacing an adapter of that name)."""
        adapter = self.read(name, path)
        with self.updater.lock, self.step_lock:
            self._install(adapter)
        return adapter

    def read(self, name: str, path: str) -> Adapter:
        """The adapter of the peft directory ``path``, checked against the model; nothing is served yet."""
        if not name or any(c in name for c in "/ \t\n"):
            raise LoraError(f"lora_name {name!r} is not a valid adapter name")
        config, raw = read_peft_dir(path)
        rank, scale = adapter_scale(config, path)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in raw.items():
            module, factor = _split_key(key, path)
            pairs.setdefault(module, {})[factor] = tensor
        # A freshly loaded adapter is as current as the engine: it holds the engine's weight version.
        adapter = Adapter(name=name, path=str(path), rank=rank, scale=scale, version=self.updater.version)
        for module, fac in sorted(pairs.items()):
            linear = self.linears.get(module)
            if linear is None:
                raise LoraError(
                    f"adapter {path!r} adapts {module!r}, which is not a linear module of this model"
                )
            if set(fac) != {"A", "B"}:
                raise LoraError(
                    f"adapter {path!r}: module {module!r} lacks lora_{({'A', 'B'} - set(fac)).pop()}"
                )
            a, b = fac["A"], fac["B"]
            if tuple(a.shape) != (rank, linear.in_features) or tuple(b.shape) != (linear.out_features, rank):
                raise LoraError(
                    f"adapter {path!r}: {module!r} has A {list(a.shape)} and B {list(b.shape)}; this model's "
                    f"linear takes [{rank}, {linear.in_features}] and [{linear.out_features}, {rank}]"
                )
            adapter.factors[module] = (
                a.to(self.device, self.dtype).contiguous(),
                b.to(self.device, self.dtype).contiguous(),
            )
        if not adapter.factors:
            raise LoraError(f"adapter {path!r} holds no lora_A / lora_B tensors")
        return adapter

    def _install(self, adapter: Adapter) -> None:
        """Serve ``adapter`` (the caller holds the updater's lock and the step lock)."""
        old = self.adapters.get(adapter.name)
        if old is not None:
            self.updater.remove_tensors(list(old.tensors()))
        self.adapters[adapter.name] = adapter
        self.updater.add_tensors(adapter.tensors())
        for module in adapter.factors:
            if module not in self._hooks:
                self._hooks[module] = self.linears[module].register_forward_hook(self._hook(module))

    def unload(self, name: str) -> None:
        with self.updater.lock, self.step_lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise LoraError(f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self.adapters)})")
            self.updater.remove_tensors(list(adapter.tensors()))
            used = {m for a in self.adapters.values() for m in a.factors}
            for module in [m for m in self._hooks if m not in used]:
                self._hooks.pop(module).remove()

    def check_name(self, name: str | None) -> None:
        """A request's ``lora_path``: None (the base) or a loaded adapter's name."""
        if name is not None and name not in self.adapters:
            raise LoraError(f"lora_path {name!r} is not a loaded adapter (loaded: {sorted(self.adapters)})")

    def tensor_names(self, name: str) -> list[str]:
        self.check_name(name)
        return list(self.adapters[name].tensors())

    def on_commit(self, names: Sequence[str], version: str) -> None:
        """A committed update: every adapter it wrote tensors of now holds ``version``."""
        written = set(names)
        for adapter in self.adapters.values():
            if written & set(adapter.tensors()):
                adapter.version = str(version)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "name": a.name,
                "path": a.path,
                "rank": a.rank,
                "scale": a.scale,
                "modules": len(a.factors),
                "weight_version": a.version,
            }
            for a in self.adapters.values()
        ]

    def slots_info(self) -> dict[str, Any] | None:
        """The paged path's adapter slots (None here: this path has no slots and no limit)."""
        return None

    # ---------------------------------------------------------------- serving

    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """Apply ``names[i]``'s adapter (None: none) to row ``i`` of the forwards inside the block."""
        active: list[tuple[Adapter, torch.Tensor | None]] = []
        for name in sorted({n for n in names if n is not None}):
            adapter = self.adapters.get(name)
            if adapter is None:  # unloaded while queued: fail the step, naming it
                raise LoraError(f"LoRA adapter {name!r} was unloaded")
            index = [i for i, n in enumerate(names) if n == name]
            rows = None if len(index) == len(names) else torch.tensor(index, device=self.device)
            active.append((adapter, rows))
        self._active = active
        try:
            yield
        finally:
            self._active = []

    def _hook(self, module: str) -> Any:
        def hook(
            _mod: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> torch.Tensor | None:
            if not self._active:
                return None
            x = args[0]
            for adapter, rows in self._active:
                factors = adapter.factors.get(module)
                if factors is None:
                    continue
                a, b = factors
                if rows is None:
                    output = output + adapter.scale * nn.functional.linear(nn.functional.linear(x, a), b)
                else:
                    delta = nn.functional.linear(nn.functional.linear(x.index_select(0, rows), a), b)
                    output = output.index_add(0, rows, delta, alpha=adapter.scale)
            return output

        return hook


def _split_key(key: str, path: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` (or ``.lora_A.<adapter>.weight``) -> (module, "A")."""
    name = key.removeprefix(PEFT_PREFIX)
    for factor in ("A", "B"):
        marker = f".lora_{factor}."
        if marker in name:
            module, rest = name.split(marker, 1)
            if rest == "weight" or (rest.endswith(".weight") and rest.count(".") == 1):
                return module, factor
    raise LoraError(f"adapter {path!r} holds tensor {key!r}, which is not a lora_A / lora_B weight")
