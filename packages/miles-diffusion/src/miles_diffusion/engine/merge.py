"""LoRA merged into the engine's base weights on arrival.

The engine samples with plain weights (no adapter in the forward pass): an adapter that arrives is
merged, ``W = W_base + scale * B A`` for a Linear and ``W[o, i, h, w] = W_base + scale * sum_r
B[o, r] A[r, i, h, w]`` for a Conv2d (peft's conv adapter: A a conv of the base's kernel, B a 1x1
conv). ``scale`` is ``alpha / r``.

The unmerged base weights of the adapted modules are kept aside, and every merge starts from them:
each update carries the trainer's whole current adapter, so merging it onto the previously merged
weights would add the old adapter in again, and subtracting the old one would leave rounding behind
after many updates.

``/load_lora_adapter`` brings the adapter's configuration (rank, alpha, modules) once, as a peft
directory (the trainer's initial adapter, or its export when the fleet catches up a restarted
engine); weight updates then carry only the factors, named ``<module>.lora_A.<adapter>.weight``.

A pipeline family's adapter wraps its transformer (:func:`miles_diffusion.lora.adapter_root`): the
peft directory names modules under the transformer (``transformer_blocks.0.attn.to_q``), and the
merger puts the root's prefix before them (``transformer.transformer_blocks.0.attn.to_q``, the
module's path in the engine's model and the name its factors arrive under).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from miles.engines.embedded.lora import LoraError, adapter_scale, read_peft_dir
from miles_diffusion.lora import MERGEABLE, PEFT_PREFIX, split_name, tensor_name


@dataclass
class MergedAdapter:
    """The adapter merged into the engine's weights."""

    name: str
    path: str
    rank: int
    scale: float
    # module path -> (A, B) as the trainer holds them (Linear: [r, in], [out, r]; Conv2d: [r, in, kh, kw], [out, r, 1, 1])
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every factor's engine name and shape (what an update must carry, all of it)."""
        out: dict[str, tuple[int, ...]] = {}
        for module, (a, b) in self.factors.items():
            out[tensor_name(module, "A", self.name)] = tuple(a.shape)
            out[tensor_name(module, "B", self.name)] = tuple(b.shape)
        return out

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values()
        )


def _expected(module: nn.Module, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    if isinstance(module, nn.Linear):
        return (rank, module.in_features), (module.out_features, rank)
    out_ch, in_ch, kh, kw = weight.shape
    return (rank, in_ch, kh, kw), (out_ch, rank, 1, 1)


class AdapterMerger:
    """Keeps the base weights of the adapted modules and merges the current adapter into the model."""

    def __init__(self, model: nn.Module, prefix: str = "") -> None:
        self.model = model
        self.prefix = prefix
        """The adapter root's path in ``model`` (``transformer.`` for a pipeline family), put before
        the module paths of a peft directory."""
        self.modules = {
            name: mod
            for name, mod in model.named_modules()
            if isinstance(mod, MERGEABLE) and not (isinstance(mod, nn.Conv2d) and mod.groups != 1)
        }
        self.adapter: MergedAdapter | None = None
        self._base: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------- loading

    def read(self, name: str, path: str) -> MergedAdapter:
        """The adapter of the peft directory ``path``, checked against the model; nothing changes yet."""
        if not name or any(c in name for c in "/. \t\n"):
            raise LoraError(f"lora_name {name!r} is not a valid adapter name (no dots, slashes or spaces)")
        config, raw = read_peft_dir(path)
        rank, scale = adapter_scale(config, path)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in raw.items():
            parts = split_name(key.removeprefix(PEFT_PREFIX))
            if parts is None:
                raise LoraError(f"adapter {path!r} holds {key!r}, which is not a lora_A / lora_B weight")
            module, factor, _ = parts
            pairs.setdefault(self.prefix + module, {})[factor] = tensor
        if not pairs:
            raise LoraError(f"adapter {path!r} holds no lora_A / lora_B tensors")
        adapter = MergedAdapter(name=name, path=str(path), rank=rank, scale=scale)
        for module, fac in sorted(pairs.items()):
            target = self.modules.get(module)
            if target is None:
                raise LoraError(
                    f"adapter {path!r} adapts {module!r}, which is not a Linear or (ungrouped) Conv2d of this model"
                )
            if set(fac) != {"A", "B"}:
                raise LoraError(
                    f"adapter {path!r}: module {module!r} lacks lora_{({'A', 'B'} - set(fac)).pop()}"
                )
            self._check(module, fac["A"], fac["B"], rank, f"adapter {path!r}")
            adapter.factors[module] = (fac["A"].float(), fac["B"].float())
        return adapter

    def _check(self, module: str, a: torch.Tensor, b: torch.Tensor, rank: int, where: str) -> None:
        want_a, want_b = _expected(self.modules[module], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraError(
                f"{where}: {module!r} has A {list(a.shape)} and B {list(b.shape)}; this model's "
                f"{type(self.modules[module]).__name__} takes {list(want_a)} and {list(want_b)}"
            )
        if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
            raise LoraError(
                f"{where}: {module!r} factors have dtype {a.dtype} / {b.dtype}, not floating point"
            )

    def install(self, adapter: MergedAdapter) -> None:
        """Serve ``adapter``: the previous one (any name) is taken out, this one merged into the base."""
        self.unload()
        with torch.no_grad():
            for module in adapter.factors:
                weight = self.modules[module].weight
                assert isinstance(weight, torch.Tensor)
                self._base[module] = weight.detach().clone()
        self.adapter = adapter
        self._merge()

    def unload(self) -> None:
        """Back to the base weights exactly (the copies kept aside)."""
        with torch.no_grad():
            for module, base in self._base.items():
                weight = self.modules[module].weight
                assert isinstance(weight, torch.Tensor)
                weight.copy_(base)
        self._base = {}
        self.adapter = None

    # ---------------------------------------------------------------- updates

    def check_update(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Factors of an update: each must be one of the merged adapter's, of its shape."""
        if self.adapter is None:
            raise LoraError(
                f"{where}: LoRA tensors arrived, but no adapter is loaded; POST /load_lora_adapter first"
            )
        expected = self.adapter.shapes()
        for name, t in tensors.items():
            if name not in expected:
                raise LoraError(
                    f"{where}: {name!r} is not a tensor of the loaded adapter {self.adapter.name!r} "
                    f"(e.g. {next(iter(expected))!r})"
                )
            if tuple(t.shape) != expected[name]:
                raise LoraError(
                    f"{where}: {name!r} has shape {tuple(t.shape)}, the adapter's is {expected[name]}"
                )
            if not t.dtype.is_floating_point:
                raise LoraError(f"{where}: {name!r} has dtype {t.dtype}, not floating point")

    def commit(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the adapter's factors with ``tensors`` (all of them) and merge again from the base."""
        assert self.adapter is not None
        missing = sorted(set(self.adapter.shapes()) - set(tensors))
        if missing:
            raise LoraError(
                f"an adapter update must carry the whole adapter; {len(missing)} of its tensors are missing "
                f"(e.g. {missing[:2]})"
            )
        factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module in self.adapter.factors:
            a = tensors[tensor_name(module, "A", self.adapter.name)]
            b = tensors[tensor_name(module, "B", self.adapter.name)]
            factors[module] = (a.float(), b.float())
        self.adapter.factors = factors
        self._merge()

    def _merge(self) -> None:
        assert self.adapter is not None
        with torch.no_grad():
            for module, (a, b) in self.adapter.factors.items():
                weight = self.modules[module].weight
                assert isinstance(weight, torch.Tensor)
                base = self._base[module]
                # In place, no delta-sized temporaries: W = W_base, then W += scale * B A as one GEMM
                # (a Conv2d's kernel flattened to [out, in * kh * kw], A's to [r, in * kh * kw]).
                weight.copy_(base)
                a2 = a.to(base.device, base.dtype).reshape(a.shape[0], -1)
                b2 = b.to(base.device, base.dtype).reshape(b.shape[0], -1)
                weight.view(weight.shape[0], -1).addmm_(b2, a2, alpha=self.adapter.scale)

    def describe(self) -> dict[str, Any] | None:
        a = self.adapter
        if a is None:
            return None
        return {
            "name": a.name,
            "path": a.path,
            "rank": a.rank,
            "scale": a.scale,
            "modules": len(a.factors),
            "bytes": a.nbytes(),
            "merged": True,
        }
