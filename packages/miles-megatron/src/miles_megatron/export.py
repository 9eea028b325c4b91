"""Per-rank views of the full (TP = 1) megatron state dict, and the weight stream back to HF names.

Loading: ``shard_for_rank`` cuts the full megatron state dict (``convert.hf_to_megatron``) into
what one rank's model holds: its pipeline stage's layers (renumbered from 0, as megatron numbers
them inside a stage), the embedding on the first stage, the final norm and output layer on the
last, its experts (EP) and its tensor-parallel shards (TP, or ETP for experts).

Export: ``iter_export`` runs on every rank of a stage; for each parameter it asks ``gather``
for the TP (ETP) shards of the group in rank order (on TP = 1 the local tensor alone), joins
them (``convert.tp_unshard``) and converts them back to HF names and layouts
(``convert.rule_to_hf``). Ordinary parameters first, then the experts (the transports bucket
the expert pass on its own). With EP > 1 each expert-parallel rank yields its own experts under
their global numbers. Every size comes from the ``ParallelLayout``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import torch

from miles.errors import ModelError
from miles_megatron.convert import Rule, Spec, rule_to_hf, table, tp_shard, tp_unshard
from miles_megatron.hf_config import HFModel
from miles_megatron.layout import ParallelLayout

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_EMBEDDING = "embedding.word_embeddings.weight"

# (name, local tensor, group: "tp" or "etp") -> the group's shards in rank order
Gather = Callable[[str, torch.Tensor, str], list[torch.Tensor]]


def is_expert(name: str) -> bool:
    return ".local_experts." in name


def stage_layers(layout: ParallelLayout, num_layers: int, pp_rank: int) -> range:
    """The global layer numbers pipeline stage ``pp_rank`` holds (an even split)."""
    per = num_layers // layout.pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def local_name(
    model: HFModel, layout: ParallelLayout, global_name: str, pp_rank: int, ep_rank: int
) -> str | None:
    """``global_name`` as rank (``pp_rank``, ``ep_rank``) names it, or None when that rank does not hold it."""
    name = global_name
    m = _LAYER.match(name)
    if m is None:
        first, last = pp_rank == 0, pp_rank == layout.pp - 1
        if name.startswith("embedding."):
            return name if first else None
        return name if last else None  # final norm, output layer
    layers = stage_layers(layout, model.num_layers, pp_rank)
    layer = int(m.group(1))
    if layer not in layers:
        return None
    name = f"decoder.layers.{layer - layers.start}." + name[m.end() :]
    e = _EXPERT.search(name)
    if e is not None:
        per = model.num_experts // layout.ep
        expert = int(e.group(1))
        if expert // per != ep_rank:
            return None
        name = name[: e.start()] + f".local_experts.{expert % per}." + name[e.end() :]
    return name


def global_name(model: HFModel, layout: ParallelLayout, local: str, pp_rank: int) -> str:
    """The whole model's name of ``local`` as pipeline stage ``pp_rank`` names it (the inverse of
    :func:`local_name` for a dense model: its layer numbered back from the stage's first)."""
    m = _LAYER.match(local)
    if m is None:
        return local
    start = stage_layers(layout, model.num_layers, pp_rank).start
    return f"decoder.layers.{int(m.group(1)) + start}." + local[m.end() :]


def shard_for_rank(
    model: HFModel, layout: ParallelLayout, rank: int, full: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The part of the full megatron state dict ``full`` that global ``rank``'s model holds, by its local names."""
    c = layout.coords(rank)
    out = {}
    for name, tensor in full.items():
        local = local_name(model, layout, name, c.pp, c.ep)
        if local is None:
            continue
        size, index = (layout.etp, c.etp) if is_expert(name) else (layout.tp, c.tp)
        out[local] = tp_shard(name, tensor, size, index)
    if model.tie_word_embeddings and layout.pp > 1 and c.pp == layout.pp - 1:
        # megatron keeps the tied embedding's copy on the last stage as its output layer's weight
        # (vocab-parallel like the embedding); weight export sends the first stage's only.
        out["output_layer.weight"] = tp_shard(_EMBEDDING, full[_EMBEDDING], layout.tp, c.tp)
    return out


def _stage_rules(
    model: HFModel, layout: ParallelLayout, pp_rank: int, ep_rank: int, spec: Spec
) -> list[tuple[Rule, str]]:
    rules = []
    for rule in table(model, spec):
        local = local_name(model, layout, rule.megatron, pp_rank, ep_rank)
        if local is not None:
            rules.append((rule, local))
    return rules


def iter_export(
    model: HFModel,
    layout: ParallelLayout,
    rank: int,
    local_state: Mapping[str, torch.Tensor],
    gather: Gather | None = None,
    spec: Spec = "local",
    part: Literal["all", "ordinary", "experts"] = "all",
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of what rank ``rank``'s stage holds: ordinary parameters, then experts.

    ``part`` picks one pass: the ``ParallelLayout.export_sources`` send the ordinary one, the
    ``expert_export_sources`` the expert one (on one GPU rank 0 is both: ``all``).

    A collective over the rank's TP (and ETP) group when those are larger than 1: every rank of
    the group must drain the stream in the same order. ``gather`` is required then.
    """
    c = layout.coords(rank)
    rules = _stage_rules(model, layout, c.pp, c.ep, spec)
    ordinary = [(r, n) for r, n in rules if not is_expert(n)]
    experts = [(r, n) for r, n in rules if is_expert(n)]
    chosen = {"all": ordinary + experts, "ordinary": ordinary, "experts": experts}[part]
    for rule, local in chosen:
        if local not in local_state:
            raise ModelError(f"megatron: rank {rank}'s model has no {local} (needed for {rule.hf[0]})")
        tensor = local_state[local].detach()
        group = "etp" if is_expert(local) else "tp"
        size = layout.etp if group == "etp" else layout.tp
        if size > 1:
            if gather is None:
                raise ValueError(f"iter_export: {group.upper()}={size} needs a gather function")
            tensor = tp_unshard(rule.megatron, gather(local, tensor, group))
        yield from zip(rule.hf, rule_to_hf(model, rule, tensor), strict=True)
