"""Parallel layout planning: TP x PP x CP x EP x ETP over a world, data parallelism the rest.

``plan_layout`` turns the recipe's ``megatron`` section into one frozen ``ParallelLayout``
that the rest of the backend reads (nothing else computes sizes or touches megatron-core's
parallel-state globals). Two grids share the same ranks, as in megatron-core:

- dense grid: ``world = TP * CP * DP * PP`` (order ``tp-cp-dp-pp``, TP fastest);
- expert grid: ``world = ETP * EP * EDP * PP`` (order ``etp-ep-edp-pp``), where the expert
  data-parallel size EDP is what ETP x EP leave of ``TP * CP * DP``.

``check_model`` refuses a layout the model's shape cannot be split by (heads, KV heads, FFN
width, layers, experts), each problem in one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.errors import ConfigError
from miles_megatron.config import MegatronOptions
from miles_megatron.hf_config import HFModel


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in both grids."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that a parallel layout must divide."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    num_experts: int = 0  # 0: dense
    moe_ffn_hidden: int = 0

    @classmethod
    def of(cls, model: HFModel) -> ModelShape:
        return cls(
            num_layers=model.num_layers,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            ffn_hidden=model.ffn_hidden,
            num_experts=model.num_experts,
            moe_ffn_hidden=model.moe_ffn_hidden,
        )


@dataclass(frozen=True)
class ParallelLayout:
    """Every parallel size of one run; the only place the backend reads them from."""

    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    edp: int
    sequence_parallel: bool = False

    def coords(self, rank: int) -> RankCoords:
        """The coordinates of ``rank`` in the dense and expert grids."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        in_stage = rank % (self.world // self.pp)
        etp, rest = in_stage % self.etp, in_stage // self.etp
        ep, edp = rest % self.ep, rest // self.ep
        return RankCoords(rank=rank, tp=tp, cp=cp, dp=dp, pp=pp, etp=etp, ep=ep, edp=edp)

    def stage_ranks(self, pp: int) -> list[int]:
        """The global ranks of pipeline stage ``pp``."""
        size = self.world // self.pp
        return list(range(pp * size, (pp + 1) * size))

    def export_sources(self) -> list[int]:
        """One rank per pipeline stage that sends that stage's gathered weights (tp = cp = dp = 0)."""
        return [r for r in range(self.world) if (c := self.coords(r)).tp == 0 and c.cp == 0 and c.dp == 0]

    def expert_export_sources(self) -> list[int]:
        """The ranks that send experts: one per (pipeline stage, EP rank), with etp = edp = 0.

        Each holds a different slice of the experts, so the expert pass has EP senders per stage
        (with EP = 1 they are the ``export_sources``)."""
        return [r for r in range(self.world) if (c := self.coords(r)).etp == 0 and c.edp == 0]

    def megatron_kwargs(self) -> dict[str, int]:
        """Arguments of ``megatron.core.parallel_state.initialize_model_parallel``."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
        }

    def check_model(self, shape: ModelShape) -> None:
        """Refuse a layout that ``shape`` cannot be split by (one sentence per problem)."""
        problems = []

        def need(ok: bool, text: str) -> None:
            if not ok:
                problems.append(text)

        need(
            shape.num_heads % self.tp == 0,
            f"{shape.num_heads} attention heads do not split over TP={self.tp}",
        )
        need(
            shape.num_kv_heads % self.tp == 0,
            f"{shape.num_kv_heads} key/value heads do not split over TP={self.tp}",
        )
        need(
            shape.num_layers % self.pp == 0,
            f"{shape.num_layers} layers do not split into PP={self.pp} stages",
        )
        if shape.num_experts:
            need(
                shape.num_experts % self.ep == 0,
                f"{shape.num_experts} experts do not split over EP={self.ep}",
            )
            need(
                shape.moe_ffn_hidden % self.etp == 0,
                f"expert FFN width {shape.moe_ffn_hidden} does not split over ETP={self.etp}",
            )
        else:
            need(
                shape.ffn_hidden % self.tp == 0,
                f"FFN width {shape.ffn_hidden} does not split over TP={self.tp}",
            )
            need(self.ep == 1, f"EP={self.ep} needs a mixture-of-experts model; this one is dense")
            need(self.etp == self.tp, f"ETP={self.etp} needs a mixture-of-experts model; this one is dense")
        if problems:
            raise ConfigError("megatron: the parallel layout does not fit the model: " + "; ".join(problems))


def plan_layout(options: MegatronOptions, world: int | None = None) -> ParallelLayout:
    """The layout of ``options`` over ``world`` ranks (default ``options.num_ranks``)."""
    world = options.num_ranks if world is None else world
    tp, pp, cp, ep = (
        options.tensor_parallel,
        options.pipeline_parallel,
        options.context_parallel,
        options.expert_parallel,
    )
    etp = options.expert_tensor_parallel or tp
    model = tp * pp * cp
    if world % model:
        raise ConfigError(
            f"megatron: TP x PP x CP = {tp} x {pp} x {cp} = {model} does not divide the world of {world} ranks "
            "(megatron.num_ranks)"
        )
    dp = world // model
    stage = tp * cp * dp
    if stage % (etp * ep):
        raise ConfigError(
            f"megatron: ETP x EP = {etp} x {ep} = {etp * ep} does not divide the {stage} ranks of a pipeline "
            f"stage (TP x CP x DP = {tp} x {cp} x {dp})"
        )
    if options.sequence_parallel and tp == 1:
        raise ConfigError("megatron: sequence_parallel needs tensor_parallel > 1")
    return ParallelLayout(
        world=world,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        etp=etp,
        dp=dp,
        edp=stage // (etp * ep),
        sequence_parallel=options.sequence_parallel,
    )
