"""Routing replay (R3) on a Hugging Face MoE model: a forward hook on every router.

Qwen3-MoE's router (transformers 5.x ``Qwen3MoeTopKRouter``, ``mlp.gate`` of each sparse layer)
takes the layer's flattened hidden states and returns ``(router_logits, routing_weights,
expert_indices)``; the sparse block runs the experts ``expert_indices`` weighted by
``routing_weights``. A forward hook may replace a module's output, and PyTorch calls hooks as
part of the module's own forward, so the replay needs no change to the model's code.

While a micro-batch runs (:meth:`RouterReplay.micro_batch`), each router's hook reads the
recorded experts of its layer for every position (laid out as the router sees them:
``miles_fsdp.batching.routing_grid``) and

- counts the positions whose own top-k (the experts the router just chose) differs, as a set,
  from the recorded ones (the ``train/routing_mismatch`` metric);
- with replay on, returns the recorded experts instead, with routing weights computed from the
  same logits the way the router computes them for its own choice: the softmax over all experts
  (float32) gathered at the recorded experts, divided by their sum when ``norm_topk_prob``, cast
  to the logits' dtype. The weights stay a function of the router's logits, so gradients reach
  the router as they do without replay; where the recorded experts equal its own top-k the output
  is the router's own, bit for bit.

Positions with no recorded routing (-1: padding, each sample's last token) keep the router's
own choice. Hooks are installed on the policy only; reference, teacher and critic models route
freely.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from miles.errors import ComponentError

# transformers' router classes whose forward returns (logits, routing weights, expert indices), taken
# as softmax over the experts then top-k (renormalised with norm_topk_prob), which the hook recomputes.
REPLAYABLE_ROUTERS = ("Qwen3MoeTopKRouter",)


def replayable_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers the hook can replay, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if _router_class(m) in REPLAYABLE_ROUTERS]


def _router_class(module: nn.Module) -> str:
    # FSDP2's fully_shard swaps a module's class for a subclass named after it; read the model's own.
    for cls in type(module).__mro__:
        if cls.__name__ in REPLAYABLE_ROUTERS:
            return cls.__name__
    return type(module).__name__


class RouterReplay:
    """The routers of one model, hooked: mismatch counting always, replay when ``replay``."""

    def __init__(self, model: nn.Module, *, replay: bool) -> None:
        self.routers = replayable_routers(model)
        if not self.routers:
            raise ComponentError(
                "fsdp: routing replay found no router to hook (transformers' "
                f"{' / '.join(REPLAYABLE_ROUTERS)}); is the model MoE?"
            )
        self.replay = replay
        self._recorded: torch.Tensor | None = None
        # Per layer, for the micro-batch running: (mismatched, recorded) positions. Keyed by layer so
        # that a recomputed forward (gradient checkpointing) counts a layer once.
        self._layer_counts: dict[int, torch.Tensor] = {}
        self._totals: torch.Tensor | None = None
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextlib.contextmanager
    def micro_batch(self, recorded: torch.Tensor | None) -> Iterator[None]:
        """Route the forward (and a recomputation in its backward) inside by ``recorded``, a
        ``[positions, layers, k]`` grid (None: the routers route freely and count nothing)."""
        if recorded is not None:
            experts = int(getattr(self.routers[0], "num_experts", 0))
            if recorded.shape[1] != self.num_layers or int(recorded.max()) >= experts:
                raise ComponentError(
                    f"fsdp: the recorded routing has {recorded.shape[1]} MoE layers and expert ids up to "
                    f"{int(recorded.max())}; the model has {self.num_layers} MoE layers of {experts} experts. "
                    "Was it recorded with another model?"
                )
        self._recorded, self._layer_counts = recorded, {}
        try:
            yield
        finally:
            self._recorded = None
            if self._layer_counts:
                counts = torch.stack(list(self._layer_counts.values())).sum(0)
                self._totals = counts if self._totals is None else self._totals + counts
            self._layer_counts = {}

    def take_counts(self) -> tuple[int, int]:
        """(mismatched, recorded) (token, layer) pairs since the last call; reading them waits for the device."""
        totals, self._totals = self._totals, None
        if totals is None:
            return 0, 0
        mismatched, recorded = (int(x) for x in totals.tolist())
        return mismatched, recorded

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            recorded = self._recorded
            if recorded is None:
                return None
            logits, _, own = output
            ids = recorded[:, layer]
            if ids.shape != own.shape:
                raise ComponentError(
                    f"fsdp: router of MoE layer {layer} chose {tuple(own.shape)} experts (positions x k), the "
                    f"recorded routing has {tuple(ids.shape)}"
                )
            ids = ids.to(own.device)
            known = ids[:, 0] >= 0
            with torch.no_grad():
                differs = (ids.sort(-1).values != own.sort(-1).values).any(-1) & known
                self._layer_counts[layer] = torch.stack((differs.sum(), known.sum()))
            if not self.replay:
                return None
            chosen = torch.where(known[:, None], ids, own)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, chosen)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return hook
