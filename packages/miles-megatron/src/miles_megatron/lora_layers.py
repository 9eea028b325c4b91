"""megatron-core's column- and row-parallel linears with LoRA adapters (imports megatron-core).

The layer spec's linear slots take these subclasses in place of megatron's own classes
(``model_config.layer_spec``); the base weight and its forward are megatron's, untouched. Each
targeted HF part of the fused linear (``lora.LinearLora``) owns ``lora_A.<part>`` ``[r, in]`` and
``lora_B.<part>`` ``[out_part, r]``; the linear returns ``base(x) + alpha / r * B(A(dropout(x)))``
with the parts' deltas laid out as the fused output lays them out.

Tensor parallelism, following the base linear's split:

- column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` is whole on every TP rank, ``B`` holds this
  rank's output rows. ``A(x)`` passes megatron's ``copy_to_tensor_model_parallel_region`` (identity
  forward, all-reduce backward), so ``A``'s gradient (and the adapter's part of the input gradient) is
  the whole group's on every rank;
- row-parallel (``linear_proj``, ``linear_fc2``): ``A`` holds this rank's input columns, ``B`` is whole.
  ``A(x)`` is summed over the group (``reduce_from_tensor_model_parallel_region``) before ``B``.

The sharded factors carry megatron's tensor-parallel attributes, so gradient norms count every
element once, and :meth:`sharded_state_dict` shards them along the same axis for dist-checkpointing.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (  # type: ignore[import-untyped]
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (  # type: ignore[import-untyped]
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # type: ignore[import-untyped]
from torch import nn

from miles_megatron.lora import LinearLora, adapter_of


def _group_size_rank(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _factor(shape: tuple[int, int], config: Any) -> nn.Parameter:
    device = (
        torch.device("cpu")
        if config.use_cpu_initialization
        else torch.device("cuda", torch.cuda.current_device())
    )
    return nn.Parameter(torch.zeros(shape, dtype=config.params_dtype, device=device))


class _LoraMixin:
    """The adapter state and arithmetic shared by both linears.

    ``loras``: the adapters of this linear (the single form: one, keyed by part; multi-LoRA: each adapter
    that targets it, keyed ``<adapter>-<part>``). Under multi-LoRA only the ``active`` adapter adds its
    delta (:func:`activate`; None: none, the base)."""

    lora: LinearLora
    loras: tuple[LinearLora, ...]
    active: str | None
    lora_A: nn.ParameterDict
    lora_B: nn.ParameterDict
    tp_size: int
    tp_rank: int

    def _set_loras(self, lora: LinearLora | tuple[LinearLora, ...]) -> None:
        self.loras = lora if isinstance(lora, tuple) else (lora,)
        self.lora = self.loras[0]
        self.active = None
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()

    def _current(self) -> LinearLora | None:
        """The adapter the forward applies: the only one (single form), else the active one, if it adapts this linear."""
        if self.lora.adapter is None:
            return self.lora
        return next((x for x in self.loras if x.adapter == self.active), None)

    def _add_factors(
        self,
        lora: LinearLora,
        a_shape: tuple[int, int],
        b_shapes: list[tuple[int, int]],
        split: str,
        config: Any,
    ) -> None:
        for part, b_shape in zip(lora.targeted, b_shapes, strict=True):
            a, b = _factor(a_shape, config), _factor(b_shape, config)
            sharded, dim = (b, 0) if split == "B" else (a, 1)
            if self.tp_size > 1:
                set_tensor_model_parallel_attributes(sharded, True, dim, 1)
            for p in (a, b):
                p.allreduce = True  # type: ignore[attr-defined]  # megatron's DDP reads it (not an expert)
            self.lora_A[lora.key(part)] = a
            self.lora_B[lora.key(part)] = b

    def _dropped(self, x: torch.Tensor, lora: LinearLora) -> torch.Tensor:
        training = bool(getattr(self, "training", False))
        return F.dropout(x, lora.dropout, training) if lora.dropout > 0 else x

    def init_adapters(self, name: str, seed: int) -> None:
        """``A`` as torch's (and peft's) default linear init, ``B`` zero: the adapter starts as a no-op.

        Each full ``A`` is drawn from a generator seeded by ``seed`` and its parameter ``name``, and cut
        to this rank's shard, so every layout starts from the same adapter."""
        with torch.no_grad():
            for key, a in self.lora_A.items():
                full_in = a.shape[1] * (self.tp_size if getattr(a, "tensor_model_parallel", False) else 1)
                g = torch.Generator().manual_seed(
                    seed * 1_000_003 + zlib.crc32(f"{name}.lora_A.{key}".encode())
                )
                bound = 1.0 / math.sqrt(full_in)
                full = torch.empty(a.shape[0], full_in).uniform_(-bound, bound, generator=g)
                if full_in != a.shape[1]:
                    full = full.chunk(self.tp_size, dim=1)[self.tp_rank]
                a.copy_(full)
                self.lora_B[key].zero_()

    def _lora_axes(self, base: dict[str, int]) -> dict[str, int]:
        axes = dict(base)
        for key in self.lora_A:
            for factor, params in (("A", self.lora_A), ("B", self.lora_B)):
                if getattr(params[key], "tensor_model_parallel", False):
                    axes[f"lora_{factor}.{key}"] = int(params[key].partition_dim)
        return axes


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` (``linear_qkv``, ``linear_fc1``) with one adapter per targeted fused part."""

    def __init__(
        self, input_size: int, output_size: int, *, lora: LinearLora | tuple[LinearLora, ...], **kwargs: Any
    ) -> None:
        super().__init__(input_size, output_size, **kwargs)
        if self.gather_output:
            raise ValueError(
                "LoraColumnParallelLinear adapts a linear whose output stays split (gather_output=False)"
            )
        self._set_loras(lora)
        self.tp_size, self.tp_rank = _group_size_rank(self.tp_group)
        for one in self.loras:
            if sum(one.rows) != output_size:
                raise ValueError(
                    f"LoRA parts {one.parts} have {sum(one.rows)} rows; the linear has {output_size}"
                )
            rows = dict(zip(one.parts, one.rows, strict=True))
            self._add_factors(
                one,
                (one.rank, input_size),
                [(rows[p] // self.tp_size, one.rank) for p in one.targeted],
                "B",
                kwargs["config"],
            )
        self.lora_groups = max(self.lora.groups // self.tp_size, 1)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, bias = super().forward(input_, weight, runtime_gather_output)
        lora = self._current()
        if lora is None:  # multi-LoRA: the active adapter (if any) does not adapt this linear
            return output, bias
        r, key = lora.rank, lora.key
        a = (
            torch.cat([self.lora_A[key(p)] for p in lora.targeted])
            if len(lora.targeted) > 1
            else self.lora_A[key(lora.targeted[0])]
        )
        h = F.linear(self._dropped(input_, lora), a)
        h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        lead = h.shape[:-1]
        hs = dict(zip(lora.targeted, h.split(r, dim=-1), strict=True))
        if len(lora.parts) == 1:
            delta = F.linear(hs[lora.parts[0]], self.lora_B[key(lora.parts[0])])
        else:
            blocks = []
            for part, rows in zip(lora.parts, lora.rows, strict=True):
                local = rows // self.tp_size
                # An untargeted part of the fused output gets no delta.
                d = F.linear(hs[part], self.lora_B[key(part)]) if part in hs else h.new_zeros(*lead, local)
                blocks.append(d.reshape(*lead, self.lora_groups, local // self.lora_groups))
            delta = torch.cat(blocks, dim=-1).reshape(*lead, -1)
        return output + delta * lora.scale, bias

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: Any = None
    ) -> Any:
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            self._lora_axes({"weight": 0, "bias": 0}),
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """``RowParallelLinear`` (``linear_proj``, ``linear_fc2``) with an adapter: ``A`` split over the inputs."""

    def __init__(
        self, input_size: int, output_size: int, *, lora: LinearLora | tuple[LinearLora, ...], **kwargs: Any
    ) -> None:
        super().__init__(input_size, output_size, **kwargs)
        if not self.input_is_parallel:
            raise ValueError("LoraRowParallelLinear adapts a linear whose input is already split")
        self._set_loras(lora)
        self.tp_size, self.tp_rank = _group_size_rank(self.tp_group)
        for one in self.loras:
            self._add_factors(
                one, (one.rank, input_size // self.tp_size), [(output_size, one.rank)], "A", kwargs["config"]
            )

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, bias = super().forward(input_)
        lora = self._current()
        if lora is None:  # multi-LoRA: the active adapter (if any) does not adapt this linear
            return output, bias
        key = lora.key(lora.targeted[0])
        h = F.linear(self._dropped(input_, lora), self.lora_A[key])
        h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return output + F.linear(h, self.lora_B[key]) * lora.scale, bias

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: Any = None
    ) -> Any:
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            self._lora_axes({"weight": 1}),
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


LORA_LINEARS = (LoraColumnParallelLinear, LoraRowParallelLinear)


def init_adapters(model: nn.Module, seed: int) -> None:
    """Every adapter of ``model`` at its starting point (``B`` zero: the model equals its base)."""
    for name, module in model.named_modules():
        if isinstance(module, LORA_LINEARS):
            module.init_adapters(name, seed)


def freeze_base(model: nn.Module) -> None:
    """Only the adapters train: every other parameter stops requiring gradients."""
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)


def adapter_parameters(model: nn.Module, adapter: str | None = None) -> list[tuple[str, nn.Parameter]]:
    """The adapters' parameters (``adapter``: only that one's, of a multi-LoRA model)."""
    return [
        (n, p)
        for n, p in model.named_parameters()
        if ".lora_" in n and (adapter is None or adapter_of(n) == adapter)
    ]


def activate(model: nn.Module, adapter: str | None) -> None:
    """Multi-LoRA: the adapter the next forward passes apply (None: none, the base); trainability unchanged."""
    for module in model.modules():
        if isinstance(module, LORA_LINEARS):
            module.active = adapter
