"""Per-rank checkpoints read under another parallel layout than they were saved with (TP and DP changes).

A CPU checkpoint (``megatron.device: cpu``) is one directory per saved rank, ``cpu/rankNNNNN/``, with
that rank's model shards (``model.safetensors``) and torch's AdamW state of them (``optimizer.pt``:
``exp_avg`` and ``exp_avg_sq`` have their parameter's shape; ``step`` is a scalar). Under the layout it
was written with every rank reads its own directory back (the trainer's same-layout path, untouched).
Under another one, each new rank rebuilds its own shards here:

- data parallelism: the DP ranks of a TP rank hold the same replica (their gradients are summed over
  the DP group before the step), so a new rank reads the saved ranks of DP index 0 only;
- tensor parallelism: for every tensor (weights and both Adam moments alike) the saved TP shards are
  joined into the full tensor and cut to the new rank's TP index with the same knowledge of megatron's
  splits that loading from HF and weight export use (``convert.tp_unshard`` / ``tp_shard``: column-parallel
  linears and the vocab-parallel embedding / output layer along dim 0, row-parallel along dim 1,
  ``linear_fc1`` as its gate half and its up half separately, ``linear_qkv`` whole query groups per rank,
  everything else replicated, taken from TP rank 0). A saved TP size equal to the new one reads the one
  saved rank of the same TP index, unchanged (bit for bit);
- the optimizer's ``step`` counts and hyperparameters are taken as saved (equal on every rank); the
  parameter indices are the new optimizer's own. Optimizer states are matched to parameters by order:
  every layout builds the same model, whose ``named_parameters`` order does not depend on TP, and each
  rebuilt moment is checked against its parameter's shape.

LoRA checkpoints hold only the adapter and its AdamW state; its factors reshard by :func:`lora_dim`
(each targeted part of a fused linear is its own factor, so a plain split is right for them).

Streamed optimizer state (``megatron.optimizer_streaming``: FP32 masters and both moments per
parameter in each rank's bucket files) reshards the same way, one parameter at a time, into this
run's own buckets (:meth:`CPUReshard.streamed`).

What it takes: both layouts with PP = CP = EP = 1 and ETP = TP, any TP that the model's heads divide,
and any DP. A change that involves pipeline stages (either layout with PP > 1: tensors renamed per stage)
is read by name instead (``miles_megatron.reshard_stages``). ``reshard_problem`` refuses what neither
reads in one line, and the backend asks it before any rank reads a file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from miles.errors import ComponentError
from miles_megatron.config import MegatronOptions
from miles_megatron.convert import tp_shard, tp_unshard
from miles_megatron.layout import ParallelLayout, plan_layout
from miles_megatron.streaming import StreamingAdamW

# Which names are replicated over TP although convert's name table would split them (the critic's value head
# sits in the output layer's slot).
Replicated = Callable[[str], bool]


def never_replicated(name: str) -> bool:
    return False


def saved_layout(marker: Mapping[str, Any]) -> ParallelLayout:
    """The ``ParallelLayout`` a checkpoint's marker records (its ``layout`` sizes and ``world``)."""
    sizes = marker["layout"]
    return plan_layout(
        MegatronOptions(
            num_ranks=int(marker["world"]),
            device="cpu",
            tensor_parallel=int(sizes["tensor_model_parallel_size"]),
            pipeline_parallel=int(sizes["pipeline_model_parallel_size"]),
            context_parallel=int(sizes["context_parallel_size"]),
            expert_parallel=int(sizes["expert_model_parallel_size"]),
            expert_tensor_parallel=int(sizes["expert_tensor_parallel_size"]),
        )
    )


def same_layout(a: ParallelLayout, b: ParallelLayout) -> bool:
    return a.megatron_kwargs() == b.megatron_kwargs() and a.world == b.world


def reshard_problem(saved: ParallelLayout, layout: ParallelLayout) -> str | None:
    """Why a checkpoint written under ``saved`` cannot be read under ``layout`` here (None: it can)."""
    if same_layout(saved, layout):
        return None
    for name, lay in (("written", saved), ("resumed", layout)):
        if (lay.cp, lay.ep, lay.etp) != (1, 1, lay.tp):
            return (
                f"the layout it is {name} under has CP={lay.cp}, EP={lay.ep}, ETP={lay.etp}; CPU checkpoints "
                "reshard across tensor-, pipeline- and data-parallel sizes only (CP = EP = 1, ETP = TP)"
            )
    return None


def _source_ranks(saved: ParallelLayout, tp_indices: list[int]) -> list[int]:
    """The saved ranks (DP index 0) holding TP shards ``tp_indices``, in that order."""
    by_tp = {c.tp: r for r in range(saved.world) if (c := saved.coords(r)).dp == 0}
    return [by_tp[t] for t in tp_indices]


_COLUMN_LINEARS = (".linear_qkv.", ".linear_fc1.")
_ROW_LINEARS = (".linear_proj.", ".linear_fc2.")


def lora_dim(name: str) -> int | None:
    """The dimension a LoRA factor ``name`` is split along under TP (None: whole on every rank).

    ``lora_B`` of a column-parallel linear (``linear_qkv``, ``linear_fc1``: one factor per fused part,
    each rank holding its own rows of that part) splits its rows; ``lora_A`` of a row-parallel one
    (``linear_proj``, ``linear_fc2``) its input columns; the other factor of each is whole
    (``lora_layers``)."""
    if ".lora_B." in name and any(m in name for m in _COLUMN_LINEARS):
        return 0
    if ".lora_A." in name and any(m in name for m in _ROW_LINEARS):
        return 1
    return None


def reshard_tensor(
    name: str, shards: list[torch.Tensor], tp: int | None, tp_rank: int, replicated: Replicated
) -> torch.Tensor:
    """``name``'s shard ``tp_rank`` of ``tp`` from the saved TP ``shards`` (``tp`` None: the one shard as it is)."""
    if tp is None or replicated(name):
        return shards[0]
    if ".lora_" in name:  # an adapter factor: a plain split (each fused part is its own factor)
        dim = lora_dim(name)
        if dim is None:
            return shards[0]
        return torch.cat(shards, dim=dim).chunk(tp, dim=dim)[tp_rank].contiguous()
    return tp_shard(name, tp_unshard(name, shards), tp, tp_rank).contiguous()


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in its state dict's index order."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


class CPUReshard:
    """Reads the per-rank files of a checkpoint written under ``saved`` for rank ``rank`` of ``layout``."""

    def __init__(self, directory: str, saved: ParallelLayout, layout: ParallelLayout, rank: int) -> None:
        problem = reshard_problem(saved, layout)
        if problem is not None:
            raise ComponentError(f"checkpoint {directory} cannot be resharded: {problem}")
        if saved.pp != 1 or layout.pp != 1:  # names (and the optimizer's order) change between stages
            raise ComponentError(
                f"checkpoint {directory}: a change with pipeline stages is read by name "
                "(miles_megatron.reshard_stages.StageReshard), not by CPUReshard"
            )
        self.directory, self.saved, self.layout = directory, saved, layout
        self.tp_rank = layout.coords(rank).tp
        # The same TP size: only the saved rank of this TP index is read (a DP change), bit for bit.
        self.tp_indices = [self.tp_rank] if saved.tp == layout.tp else list(range(saved.tp))
        self.sources = _source_ranks(saved, self.tp_indices)
        # The TP size and index the joined tensors are cut to (None: the one saved shard passes through).
        self.tp: int | None = None if saved.tp == layout.tp else layout.tp

    def _path(self, source: int, file: str) -> str:
        return os.path.join(self.directory, "cpu", f"rank{source:05d}", file)

    def streamed(self, optimizer: StreamingAdamW) -> None:
        """This rank's streamed AdamW state (bucket files; the parameters become their masters) from the
        saved ranks' (``streaming/rankNNNNN/``)."""
        sources = [os.path.join(self.directory, "streaming", f"rank{s:05d}") for s in self.sources]

        def one(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
            return reshard_tensor(name, shards, self.tp, self.tp_rank, never_replicated)

        optimizer.load_resharded(sources, one, f"checkpoint {self.directory}")

    def tensors(
        self, weights_file: str, replicated: Replicated = never_replicated
    ) -> dict[str, torch.Tensor]:
        """This rank's model tensors from the saved ranks' ``weights_file`` (safetensors)."""
        from safetensors.torch import load_file

        saved = [load_file(self._path(s, weights_file)) for s in self.sources]
        return {
            name: reshard_tensor(name, [s[name] for s in saved], self.tp, self.tp_rank, replicated)
            for name in saved[0]
        }

    def optimizer_state(
        self,
        optimizer_file: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        replicated: Replicated = never_replicated,
    ) -> dict[str, Any]:
        """A state dict for this rank's ``optimizer`` (torch's AdamW over ``model``) from the saved ranks'."""
        # weights_only: a checkpoint file never runs code when it is read.
        saved = [torch.load(self._path(s, optimizer_file), weights_only=True) for s in self.sources]
        own = optimizer.state_dict()
        names = param_names(model, optimizer)
        first = saved[0]
        if len(first["param_groups"]) != len(own["param_groups"]) or sum(
            len(g["params"]) for g in first["param_groups"]
        ) != len(names):
            raise ComponentError(
                f"checkpoint {self.directory}: its optimizer state has {len(first['param_groups'])} group(s) of "
                f"{sum(len(g['params']) for g in first['param_groups'])} parameter(s), this model's optimizer "
                f"{len(own['param_groups'])} of {len(names)}; it was written by another model"
            )
        params = dict(model.named_parameters())
        state: dict[int, dict[str, Any]] = {}
        for index, name in enumerate(names):
            if index not in first["state"]:
                continue  # never stepped
            entry: dict[str, Any] = {}
            for key, value in first["state"][index].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = reshard_tensor(
                        name, [s["state"][index][key] for s in saved], self.tp, self.tp_rank, replicated
                    )
                    if value.shape != params[name].shape:
                        raise ComponentError(
                            f"checkpoint {self.directory}: {name}'s {key} resharded to {tuple(value.shape)}, "
                            f"the parameter is {tuple(params[name].shape)}"
                        )
                entry[key] = value
            state[index] = entry
        groups = [
            {**g, "params": list(o["params"])}
            for g, o in zip(first["param_groups"], own["param_groups"], strict=True)
        ]
        return {"state": state, "param_groups": groups}
