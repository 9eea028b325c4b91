"""Ulysses sequence parallelism for the trainer's re-scoring of long token sequences (video).

With ``sequence_parallel: S`` the FSDP2 ranks form groups of ``S`` neighbours that re-score the same
trajectories: each rank of a group runs the transformer on ``1/S`` of the video tokens, and inside
every attention layer an all-to-all trades the sequence split for a head split (each rank attends over
the whole sequence for ``heads/S`` heads), then trades it back (DeepSpeed-Ulysses). Activation memory
per rank falls by about ``S`` for the blocks, which is what lets a long video's re-scoring fit.

The mechanism is diffusers' own: a transformer class declares in ``_cp_plan`` which inputs are split
and which output is gathered, and its attention dispatch runs the Ulysses exchange when a parallel
config is attached. :func:`apply_sequence_parallel` attaches it: through
``ModelMixin.enable_parallelism`` on CUDA; on the CPU (gloo) it performs the same three steps itself
(set up the config on the given mesh, hand it to the attention processors, install the plan's hooks),
because diffusers 0.42's ``enable_parallelism`` picks the device as ``rank % device_count()``, a
division by zero without an accelerator.

Gradients: every rank of a group computes the group's whole loss from the gathered output; the
gather's backward hands each rank the gradient of its own slice, so each rank's parameter gradients
are the share its tokens contribute, and FSDP2's summed reduction (miles-fsdp's rule) adds the shares
of a group and the groups of the data-parallel dimension: the one-process gradient.

A family supports it when its transformer has a plan and the family can say, from the directory's
config files alone, what the plan splits (:class:`SequenceSplit`, ``ModelFamily.sequence_split``):
Wan (the video tokens; the text is not split). Every split length and the head count must be
multiples of ``S`` (checked before anything starts). Not offered: LTX-Video and Qwen-Image, whose
diffusers classes declare a plan too, because their cross-attention takes a text mask and, tried on
the LTX proxy, the Ulysses exchange left the mask with every head while the rank held half of them
(the native backend's SDPA refused the broadcast); ring attention, because diffusers' native (SDPA)
backend, the one that runs on the CPU, cannot return the log-sum-exp it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "SequenceSplit",
    "apply_sequence_parallel",
    "check_sequence_parallel",
]


@dataclass(frozen=True)
class SequenceSplit:
    """What a family's sequence-parallel forward splits over the ranks of a group: the length of each
    split sequence (by name, for the error message) and the attention heads the all-to-all divides."""

    lengths: dict[str, int]
    heads: int

    def error(self, degree: int) -> str | None:
        """Why ``degree`` ranks cannot split this, or None."""
        bad = {name: n for name, n in self.lengths.items() if n % degree}
        if bad:
            named = ", ".join(f"{n} {name}" for name, n in bad.items())
            return f"{named} do not split evenly over {degree} ranks"
        if self.heads % degree:
            return f"{self.heads} attention heads do not split evenly over {degree} ranks"
        return None


def check_sequence_parallel(directory: str | Path, degree: int) -> None:
    """Raise ``ValueError`` (one line) unless the model in ``directory`` can be re-scored by groups of
    ``degree`` sequence-parallel ranks; judged from its config files, no weights read."""
    if degree == 1:
        return
    from miles_diffusion.families import family_for

    family = family_for(Path(directory))
    if family.sequence_split is None:
        from miles_diffusion.families import families

        supported = sorted(name for name, f in families().items() if f.sequence_split is not None)
        raise ValueError(
            f"sequence_parallel {degree}: the {family.name} family has no sequence-parallel split "
            f"(supported: {', '.join(supported)}); set it to 1"
        )
    reason = family.sequence_split(Path(directory)).error(degree)
    if reason is not None:
        raise ValueError(f"sequence_parallel {degree}: {directory}: {reason}; pick a divisor")


def apply_sequence_parallel(transformer: nn.Module, mesh: Any) -> None:
    """Split ``transformer``'s forward over ``mesh`` (a device mesh with dimensions ``ring`` of size 1
    and ``ulysses``): Ulysses attention through diffusers' context-parallel plan. Apply before FSDP2
    sharding; the state dict and the parameters are unchanged."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    plan = getattr(transformer, "_cp_plan", None)
    if not plan:
        raise ValueError(f"{type(transformer).__name__} declares no context-parallel plan (_cp_plan)")
    degree = int(mesh["ulysses"].size())
    cp = ContextParallelConfig(ulysses_degree=degree, mesh=mesh)
    enable = getattr(transformer, "enable_parallelism", None)
    if mesh.device_type != "cpu" and callable(enable):
        enable(config=cp)
        return
    # diffusers' enable_parallelism, without its accelerator-only device choice (module docstring)
    config = ParallelConfig(context_parallel_config=cp)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config.setup(rank, world, torch.device("cpu"), mesh=mesh)
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    cast(Any, transformer)._parallel_config = config  # what enable_parallelism records on the model
    apply_context_parallel(transformer, cp, plan)
