"""Records which experts each MoE router chose, for routing replay (R3).

Hugging Face MoE blocks call a router module on the flattened hidden states of a
forward pass. In transformers 5.x the Qwen3-MoE router is
``model.layers[i].mlp.gate`` (``Qwen3MoeTopKRouter``), whose forward returns
``(router_logits, router_scores, router_indices)``; older-style MoE blocks use a
plain ``nn.Linear`` gate that returns logits, from which the top-k is taken here
the same way the block does (softmax, then top-k). Forward hooks on those modules
collect the indices while a capture is active; nothing is recorded otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _router_modules(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, returns_indices) for every router, in layer order."""
    found = [(n, m, True) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
    if not found:
        found = [
            (n, m, False)
            for n, m in model.named_modules()
            if n.endswith("mlp.gate") and isinstance(m, nn.Linear)
        ]
    return found


class RoutingRecorder:
    """Hooks every router once; ``capture()`` turns recording on for one forward pass."""

    def __init__(self, model: nn.Module) -> None:
        # A transformers model's PretrainedConfig (nn.Module types unknown attributes as Tensor | Module).
        model_config: Any = model.config
        config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.routers = _router_modules(model)
        self.num_experts = int(
            getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0
        )
        default_topk = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.topk = (
            int(getattr(self.routers[0][1], "top_k", default_topk) or default_topk) if self.routers else 0
        )
        self._active = False
        self._captured: list[torch.Tensor] = []
        self._handles = [
            m.register_forward_hook(self._hook(returns_indices)) for _, m, returns_indices in self.routers
        ]

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _hook(self, returns_indices: bool):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active:
                return
            if returns_indices:
                indices = output[-1]
            else:
                probs = torch.softmax(output.float(), dim=-1)
                indices = torch.topk(probs, self.topk, dim=-1).indices
            self._captured.append(indices.detach())

        return hook

    def start(self) -> None:
        self._captured = []
        self._active = True

    def stop(self, batch: int, seq: int) -> torch.Tensor:
        """End the capture; returns int32 ``[batch, seq, num_layers, topk]`` on the CPU."""
        self._active = False
        captured, self._captured = self._captured, []
        if len(captured) != self.num_layers:
            raise RuntimeError(
                f"routing capture saw {len(captured)} router calls, expected {self.num_layers}"
            )
        stacked = torch.stack([c.reshape(batch, seq, -1) for c in captured], dim=2)
        return stacked.to(device="cpu", dtype=torch.int32)
