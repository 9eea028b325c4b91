"""FSDP2 data-parallel training of a diffusion model's trainable denoiser (the tiny UNet's ``unet``,
SD3's ``transformer``), on an already initialised process group (gloo on CPU, NCCL on GPUs).

:func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` through miles-fsdp's own
:func:`miles_fsdp.models.shard`: each block of the denoiser (the items of its direct
``nn.ModuleList`` children, e.g. a UNet's ``down_blocks`` / ``up_blocks`` and its ``mid_block``, or
SD3's ``transformer_blocks``), then the :class:`DiffusionModel` itself as the root. Only what trains
is a submodule of a :class:`DiffusionModel` (:mod:`miles_diffusion.denoiser`), so the frozen parts (text
encoders, VAE) stay whole and unsharded on every rank. Gradients are summed across ranks, not averaged
(miles-fsdp's rule): the trainer divides each rank's loss by the global batch, so the summed gradient
is the one-process gradient (:class:`DataParallel`).

The recipe's ``precision`` section maps onto FSDP2's ``MixedPrecisionPolicy``
(:func:`mixed_precision_options`): ``compute_dtype`` becomes the gathered parameters' dtype, the
gradient reduction stays float32, and each module named in ``fp32_modules`` is sharded first under a
float32 policy of its own, so its parameters are gathered in float32 as well.

:func:`data_parallel` makes an objective's trainer (any :class:`DataParallelTrainer`: Flow-GRPO,
DiffusionNFT, SFT) run data-parallel: the model sharded, the optimizer rebuilt over the sharded
parameters, and each rank training its share of the rows (:meth:`DataParallel.share`) on the same
seeded draws as every other rank (the same subset of steps, the same noise levels and noise).
With ``sequence_parallel`` S above 1 (a trainer with ``splits_sequences``: Flow-GRPO) the ranks form
groups of S neighbours that re-score the same rows, each on 1/S of the token sequence
(:mod:`miles_diffusion.sequence_parallel`); the data-parallel share is then per group. Tested on CPU
over gloo only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from miles_diffusion.denoiser import DiffusionModel
from miles_diffusion.precision import PrecisionConfig
from miles_fsdp.config import FSDPOptions
from miles_fsdp.models import shard

__all__ = [
    "DataParallel",
    "DataParallelTrainer",
    "Share",
    "data_parallel",
    "denoiser_blocks",
    "mixed_precision_options",
    "shard_model",
]


@dataclass(frozen=True)
class DataParallel:
    """This rank's place in the data-parallel group: it trains rows ``rows(batch)`` of a batch.

    With sequence parallelism, ``rank`` and ``world_size`` are the data-parallel ones (of the groups
    of ``sequence_parallel`` ranks that share rows), and ``group`` the process group of the ranks
    holding the same place in each group: one member per set of rows, over which statistics sum."""

    rank: int
    world_size: int
    sequence_parallel: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    @classmethod
    def current(cls) -> DataParallel:
        """The default process group's rank and size (it must be initialised)."""
        return cls(dist.get_rank(), dist.get_world_size())

    def rows(self, batch: int) -> slice:
        """This rank's contiguous share of ``batch`` rows (the first ``batch % world_size`` ranks get
        one more); a batch smaller than the group is refused (a rank would have nothing to train)."""
        if batch < self.world_size:
            raise ValueError(f"a batch of {batch} does not split over {self.world_size} data-parallel ranks")
        base, extra = divmod(batch, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """The sum over ranks of each value (float64, one collective)."""
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return [float(v) for v in tensor]

    def share(self, batch: int) -> Share:
        """This rank's :class:`Share` of a batch of ``batch`` rows."""
        rows = self.rows(batch)
        return Share(rows, (rows.stop - rows.start) / batch, self)


@dataclass(frozen=True)
class Share:
    """A rank's rows of a batch and their fraction of it; ``place`` ``None``: one process, all rows.

    Every objective's loss is a mean over its rows: :meth:`weigh` multiplies it by ``fraction``, so the
    ranks' gradients, which FSDP2 sums, are the whole batch's; :meth:`batch_means` turns the rank's
    per-row means back into the whole batch's (one all-reduce). In one process both are the identity,
    so the one-process step is unchanged bit for bit."""

    rows: slice
    fraction: float
    place: DataParallel | None = None

    @classmethod
    def of(cls, place: DataParallel | None, batch: int) -> Share:
        """``place``'s share of ``batch`` rows, or all of them in one process."""
        return place.share(batch) if place is not None else cls(slice(0, batch), 1.0)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The share's rows of a per-row ``tensor`` (the tensor itself in one process)."""
        return tensor if self.place is None else tensor[self.rows]

    def weigh(self, loss: torch.Tensor) -> torch.Tensor:
        """A mean over the share's rows, weighted by its fraction of the batch (unchanged in one process)."""
        return loss if self.place is None else loss * self.fraction

    def batch_means(self, means: dict[str, float]) -> dict[str, float]:
        """Per-row means over the share, as the whole batch's means (unchanged in one process)."""
        if self.place is None:
            return means
        keys = sorted(means)
        summed = self.place.all_reduce_sum([means[key] * self.fraction for key in keys])
        return dict(zip(keys, summed, strict=True))


def full_norm(norm: torch.Tensor) -> float:
    """A gradient norm from ``clip_grad_norm_``, whole: over FSDP2 shards it is a DTensor."""
    if hasattr(norm, "full_tensor"):  # a DTensor over the ranks' gradient shards
        norm = norm.full_tensor()
    return float(norm)


@runtime_checkable
class DataParallelTrainer(Protocol):
    """What :func:`data_parallel` needs of an objective's trainer: its model (sharded in place), its
    optimizer (rebuilt over the shards from ``config``), and ``data_parallel``, the place it trains
    its share from (``None``: one process). ``splits_sequences``: whether it is tested with sequence
    parallelism (``sequence_parallel`` above 1)."""

    splits_sequences: ClassVar[bool]
    model: DiffusionModel
    config: Any
    optimizer: torch.optim.Optimizer
    data_parallel: DataParallel | None


def trainable_module(model: DiffusionModel) -> nn.Module:
    """The denoiser that trains: the model's one direct submodule (``unet``, ``transformer``)."""
    children = [child for child in model.children() if any(True for _ in child.parameters())]
    if len(children) != 1:
        names = [name for name, _ in model.named_children()]
        raise ValueError(f"{type(model).__name__}: expected one trainable submodule, found {names}")
    return children[0]


def denoiser_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: the items of ``module``'s direct ``nn.ModuleList`` children,
    and its ``mid_block`` when it has one (a UNet's down, mid and up blocks; SD3's transformer blocks)."""
    blocks: list[nn.Module] = []
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList):
            blocks.extend(child)
        elif name == "mid_block" and child is not None:
            blocks.append(child)
    return blocks


def mixed_precision_options(precision: PrecisionConfig) -> FSDPOptions:
    """miles-fsdp's options for a recipe's ``precision``: float32 compute keeps FSDP2's defaults (no
    casting); a BF16/FP16 ``compute_dtype`` is the gathered parameters' dtype, reduced in float32."""
    if precision.dtype is torch.float32:
        return FSDPOptions()
    return FSDPOptions(param_dtype=precision.compute_dtype, reduce_dtype="float32")


def shard_model(
    model: DiffusionModel, precision: PrecisionConfig | None = None, mesh: DeviceMesh | None = None
) -> DiffusionModel:
    """Shard ``model``'s trainable denoiser with FSDP2 in place (blocks, then the model as root) and
    return it. ``mesh``: default one data-parallel dimension over the default process group, on the
    CPU for gloo and on CUDA otherwise. Build any optimizer after this: the parameters become DTensors."""
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs an initialised process group (torch.distributed)")
    precision = precision or PrecisionConfig()
    if mesh is None:
        device = "cpu" if dist.get_backend() == "gloo" else "cuda"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    denoiser = trainable_module(model)
    blocks = denoiser_blocks(denoiser)
    if not blocks:
        raise ValueError(f"{type(denoiser).__name__}: found no blocks to shard")
    opts = mixed_precision_options(precision)
    if precision.dtype is not torch.float32:
        # The modules the model keeps in FP32 gather their parameters in float32, each a group of its own.
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        modules = dict(model.named_modules())
        kept = [modules[name] for name in getattr(model, "fp32_modules", [])]
        for module in kept:
            fully_shard(module, mesh=mesh, mp_policy=fp32, reshard_after_forward=opts.reshard_after_forward)
        blocks = [block for block in blocks if all(block is not module for module in kept)]
    shard(model, mesh, opts, f"{type(model).__name__} denoiser", layers=blocks)
    return model


def data_parallel(
    trainer: object, precision: PrecisionConfig | None = None, sequence_parallel: int = 1
) -> DataParallel:
    """Make ``trainer`` (a :class:`DataParallelTrainer`: Flow-GRPO, DiffusionNFT or SFT, built on the
    whole model) train data-parallel over the default process group: its model sharded (:func:`shard_model`), its
    optimizer rebuilt over the sharded parameters, its steps split by rows. ``sequence_parallel`` S
    above 1: groups of S neighbouring ranks share rows and split the token sequence (its transformer's
    forward parallelised first). A frozen reference model (``kl_coef > 0``) was copied whole before
    sharding and stays so. Returns this rank's place."""
    from miles_diffusion.trainer import make_optimizer

    if not isinstance(trainer, DataParallelTrainer):
        raise TypeError(f"data_parallel: {type(trainer).__name__} does not train data-parallel")
    if sequence_parallel > 1 and not trainer.splits_sequences:
        raise ValueError(
            f"data_parallel: {type(trainer).__name__} is not tested with sequence_parallel {sequence_parallel}"
        )
    if not dist.is_initialized():
        raise RuntimeError("data_parallel needs an initialised process group (torch.distributed)")
    place = DataParallel.current()
    if sequence_parallel > 1:
        place = _sequence_groups(trainer.model, sequence_parallel)
    shard_model(trainer.model, precision)
    trainer.optimizer = make_optimizer(trainer.model, trainer.config)
    trainer.data_parallel = place
    return place


def _sequence_groups(model: DiffusionModel, degree: int) -> DataParallel:
    """Groups of ``degree`` neighbouring ranks (ranks ``g*degree .. g*degree+degree-1``) split the
    denoiser's sequence; returns this rank's data-parallel place (its group's index)."""
    from miles_diffusion.sequence_parallel import apply_sequence_parallel

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % degree:
        raise ValueError(f"sequence_parallel {degree} does not divide the {world} ranks")
    device = "cpu" if dist.get_backend() == "gloo" else "cuda"
    # diffusers reads the sequence-parallel dimensions by these names (ring of size 1: Ulysses only)
    mesh = init_device_mesh(device, (world // degree, 1, degree), mesh_dim_names=("dp", "ring", "ulysses"))
    apply_sequence_parallel(trainable_module(model), mesh["ring", "ulysses"])
    return DataParallel(rank // degree, world // degree, degree, mesh["dp"].get_group())
