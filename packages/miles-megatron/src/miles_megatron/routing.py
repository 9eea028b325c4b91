"""Routing replay (R3) on megatron-core's MoE layers, through megatron-core's own replay machinery.

megatron-core (0.16+) builds each ``TopKRouter`` with a ``RouterReplay`` when
``TransformerConfig.moe_enable_routing_replay`` is set; its top-k step then asks that object for
the experts: in ``REPLAY_FORWARD`` it takes the target indices it was given and gathers the
router's scores at them (with Qwen3-MoE's settings: softmax over the recorded experts' logits
when ``norm_topk_prob``, else the full softmax gathered there, which is how Hugging Face weights
its own top-k), so gradients still reach the router through the weights. What megatron leaves to
its caller is the indices of each call; this module hands them over from a forward pre-hook on
every router, per instance (megatron's class-level list of all replay objects would mix the
routers of every model built in the process).

The pre-hook sees the router's input (``[L, B, H]``, sequence first) and, while a micro-batch
with recorded routing runs (:meth:`RouterHooks.begin`):

- computes the router's own top-k from its gating logits (no gradient) and counts the positions
  where it differs, as a set, from the recorded experts (the ``train/routing_mismatch`` metric);
- with replay on, gives the router's ``RouterReplay`` the recorded experts, the router's own
  choice where none was recorded (-1: padding, each sample's last token), and sets it to replay.

A micro-batch without recorded routing clears the replay action: the routers choose freely.
Nothing here edits megatron-core; only its documented configuration and per-instance API are used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miles.errors import ComponentError

#: The ``TransformerConfig`` field that builds each router with megatron-core's replay object.
REPLAY_FIELD = "moe_enable_routing_replay"


def supports_replay() -> bool:
    """Whether the installed megatron-core's ``TransformerConfig`` has :data:`REPLAY_FIELD`."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig  # type: ignore[import-untyped]

    return REPLAY_FIELD in {f.name for f in dataclasses.fields(TransformerConfig)}


def routers_of(model: nn.Module) -> list[nn.Module]:
    """megatron-core's top-k routers of ``model``, in layer order (empty for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter  # type: ignore[import-untyped]

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class RouterHooks:
    """Forward pre-hooks on ``routers`` (megatron ``TopKRouter`` modules, or modules with its
    ``gating(input)``, ``topk``, ``config.num_moe_experts`` and ``router_replay``)."""

    def __init__(self, routers: list[nn.Module], *, replay: bool) -> None:
        if not routers:
            raise ComponentError("megatron: routing replay found no MoE router in the model; is it MoE?")
        if replay:
            missing = [i for i, r in enumerate(routers) if getattr(r, "router_replay", None) is None]
            if missing:
                raise ComponentError(
                    f"megatron: the routers of MoE layers {missing} have no RouterReplay; the model must be "
                    f"built with TransformerConfig.{REPLAY_FIELD} for routing replay"
                )
        self.routers = routers
        self.replay = replay
        self._recorded: torch.Tensor | None = None
        # Per layer, for the micro-batch running: (mismatched, recorded) positions, folded into the
        # totals when the next micro-batch begins or the counts are taken.
        self._layer_counts: dict[int, torch.Tensor] = {}
        self._totals: torch.Tensor | None = None
        self._handles = [r.register_forward_pre_hook(self._hook(i)) for i, r in enumerate(routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def begin(self, recorded: torch.Tensor | None) -> None:
        """The next forward is a micro-batch routed by ``recorded`` (``[positions, layers, k]``, in
        the routers' token order; None: route freely)."""
        if recorded is not None:
            router: Any = self.routers[0]
            experts = int(router.config.num_moe_experts)
            if recorded.shape[1] != self.num_layers or int(recorded.max()) >= experts:
                raise ComponentError(
                    f"megatron: the recorded routing has {recorded.shape[1]} MoE layers and expert ids up to "
                    f"{int(recorded.max())}; the model has {self.num_layers} MoE layers of {experts} experts. "
                    "Was it recorded with another model?"
                )
        self._fold()
        self._recorded = recorded

    def take_counts(self) -> tuple[int, int]:
        """(mismatched, recorded) (token, layer) pairs since the last call (reading them waits for the device)."""
        self._fold()
        self._recorded = None
        totals, self._totals = self._totals, None
        if totals is None:
            return 0, 0
        mismatched, recorded = (int(x) for x in totals.tolist())
        return mismatched, recorded

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _fold(self) -> None:
        if self._layer_counts:
            counts = torch.stack(list(self._layer_counts.values())).sum(0)
            self._totals = counts if self._totals is None else self._totals + counts
        self._layer_counts = {}

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            replay: Any = getattr(module, "router_replay", None)
            recorded = self._recorded
            if recorded is None:
                if replay is not None:
                    replay.clear_router_replay_action()
                return
            with torch.no_grad():
                logits = module.gating(args[0]).reshape(-1, module.config.num_moe_experts)
                own = torch.topk(logits, module.topk, dim=-1).indices
            ids = recorded[:, layer].to(own.device)
            if ids.shape != own.shape:
                raise ComponentError(
                    f"megatron: router of MoE layer {layer} routes {tuple(own.shape)} (positions x k), the "
                    f"recorded routing has {tuple(ids.shape)}"
                )
            known = ids[:, 0] >= 0
            differs = (ids.sort(-1).values != own.sort(-1).values).any(-1) & known
            self._layer_counts[layer] = torch.stack((differs.sum(), known.sum()))
            if self.replay:
                from megatron.core.transformer.moe.router_replay import RouterReplayAction  # type: ignore[import-untyped]

                replay.clear_indices()  # one target per forward: nothing kept for a backward replay
                replay.set_target_indices(torch.where(known[:, None], ids, own))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        return hook
