"""CPU checkpoints read across pipeline-parallel sizes (a PP change, with or without TP / DP changes).

Under PP each saved rank's files hold its stage's tensors under the stage's own names (layers numbered
from 0 inside the stage, ``export.local_name``), and its AdamW state indexed by its own optimizer's
parameter order, which the checkpoint records per rank (``param_names.json``, written since pipeline
stages run). A new rank finds each of its tensors by name: its local name -> the whole model's
(``export.global_name``) -> the saved stage that holds it and that stage's local name (the per-stage
rule ``export.local_name`` again) -> that stage's saved TP shards (DP index 0: DP replicas are equal),
joined and cut to the new TP index as ``reshard`` does for a TP change. Adam's moments go the same
way, matched by name; ``step`` and the group hyperparameters are taken as saved.

A tied model under PP keeps a copy of the embedding on the last stage as the output layer's weight;
both copies always hold the same values and Adam state (the same start, the gradients summed over
megatron's embedding group, the same update), so a new last stage reads its copy from the saved
embedding whatever the saved PP was, and a saved copy is not read.

What it takes: any PP that divides the layers, any TP the heads divide, any DP; CP = EP = 1, ETP = TP;
no LoRA, critic or streamed state (they do not run with PP > 1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from miles.errors import ComponentError
from miles_megatron.export import global_name, local_name
from miles_megatron.hf_config import HFModel
from miles_megatron.layout import ParallelLayout
from miles_megatron.reshard import never_replicated, param_names, reshard_tensor

NAMES_FILE = "param_names.json"  # per rank: its optimizer's parameter names in index order
_EMBEDDING = "embedding.word_embeddings.weight"
_TIED_COPY = "output_layer.weight"


def crosses_stages(saved: ParallelLayout, layout: ParallelLayout) -> bool:
    """Whether reading a checkpoint of ``saved`` under ``layout`` renames tensors (either has PP > 1)."""
    return saved.pp > 1 or layout.pp > 1


def names_problem(directory: str, saved: ParallelLayout) -> str | None:
    """Why ``directory``'s ranks cannot be read by name (one sentence), or None."""
    missing = [r for r in range(saved.world) if not os.path.isfile(_path(directory, r, NAMES_FILE))]
    if missing:
        return (
            f"checkpoint {directory} does not record its ranks' parameter names ({NAMES_FILE}, written since "
            "pipeline stages run), which a change of megatron.pipeline_parallel needs; resume it on its own "
            "layout, or re-save it"
        )
    return None


def _path(directory: str, rank: int, file: str) -> str:
    return os.path.join(directory, "cpu", f"rank{rank:05d}", file)


class StageReshard:
    """This rank's tensors and AdamW state from a CPU checkpoint written under another PP layout."""

    def __init__(
        self, directory: str, saved: ParallelLayout, layout: ParallelLayout, rank: int, model: HFModel
    ) -> None:
        self.directory, self.saved, self.layout, self.model = directory, saved, layout, model
        c = layout.coords(rank)
        self.pp_rank, self.tp_rank = c.pp, c.tp
        tp_indices = [c.tp] if saved.tp == layout.tp else list(range(saved.tp))
        # The TP size and index the joined tensors are cut to (None: the one saved shard passes through).
        self.tp: int | None = None if saved.tp == layout.tp else layout.tp
        by_stage_tp = {(s.pp, s.tp): r for r in range(saved.world) if (s := saved.coords(r)).dp == 0}
        self.sources = {p: [by_stage_tp[(p, t)] for t in tp_indices] for p in range(saved.pp)}

    def where(self, local: str) -> tuple[int, str]:
        """The saved stage holding this rank's tensor ``local``, and that stage's name for it."""
        if local == _TIED_COPY and self.model.tie_word_embeddings:
            whole = _EMBEDDING  # the last stage's copy of the tied embedding (see the module docstring)
        else:
            whole = global_name(self.model, self.layout, local, self.pp_rank)
        for stage in range(self.saved.pp):
            name = local_name(self.model, self.saved, whole, stage, 0)
            if name is not None:
                return stage, name
        raise ComponentError(f"checkpoint {self.directory}: no saved pipeline stage holds {whole}")

    def tensors(self, weights_file: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """This rank's tensors ``names`` from the saved stages' ``weights_file`` (safetensors)."""
        from safetensors.torch import load_file

        files: dict[int, list[dict[str, torch.Tensor]]] = {}
        out = {}
        for name in names:
            stage, saved_name = self.where(name)
            if stage not in files:
                files[stage] = [
                    load_file(_path(self.directory, r, weights_file)) for r in self.sources[stage]
                ]
            shards = [f[saved_name] for f in files[stage]]
            out[name] = reshard_tensor(saved_name, shards, self.tp, self.tp_rank, never_replicated)
        return out

    def optimizer_state(
        self, optimizer_file: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """A state dict for this rank's ``optimizer`` (torch's AdamW over ``model``) from the saved stages'."""
        # weights_only: a checkpoint file never runs code when it is read.
        saved = {
            p: [torch.load(_path(self.directory, r, optimizer_file), weights_only=True) for r in ranks]
            for p, ranks in self.sources.items()
        }
        index_of = {}
        for p, ranks in self.sources.items():
            with open(_path(self.directory, ranks[0], NAMES_FILE)) as f:
                index_of[p] = {name: i for i, name in enumerate(json.load(f))}
        own = optimizer.state_dict()
        first = saved[0][0]
        if len(first["param_groups"]) != len(own["param_groups"]):
            raise ComponentError(
                f"checkpoint {self.directory}: its optimizer has {len(first['param_groups'])} parameter group(s), "
                f"this rank's {len(own['param_groups'])}; it was written by another model"
            )
        params = dict(model.named_parameters())
        state: dict[int, dict[str, Any]] = {}
        for index, name in enumerate(param_names(model, optimizer)):
            stage, saved_name = self.where(name)
            saved_index = index_of[stage].get(saved_name)
            if saved_index is None:
                raise ComponentError(f"checkpoint {self.directory}: no optimizer state for {saved_name}")
            entries = [o["state"].get(saved_index) for o in saved[stage]]
            if entries[0] is None:
                continue  # never stepped
            entry: dict[str, Any] = {}
            for key, value in entries[0].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = reshard_tensor(
                        saved_name, [e[key] for e in entries], self.tp, self.tp_rank, never_replicated
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
