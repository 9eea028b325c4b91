"""Move one rank's training state off the GPU and back (colocated placement).

When the trainer shares its GPUs with the rollout engines, the engines need that memory
while they generate. ``offload`` moves this rank's FSDP shards (parameters and any
gradients of the policy, the critic and the frozen scorers) and its optimizer state to
host memory and returns the freed blocks to the driver (``torch.cuda.empty_cache``);
``onload`` brings exactly those tensors back before the next training step. The values
are copied, never recomputed, so training after a round trip is bit-identical.

FSDP2 supports ``module.to(device)`` on a sharded module: it swaps each sharded
parameter's local tensor in place (the ``nn.Parameter`` objects, and so the optimizer's
references to them, stay the same) and re-registers the shard storage it all-gathers from.
Optimizer state tensors are moved one by one, remembering which ones, so state that lives
on the CPU by design (Adam's ``step`` counters) stays there.

With ``fsdp.pin_offload`` (the default) every copy is issued ``non_blocking``: a device-to-host
copy then lands in page-locked host memory (torch allocates the destination pinned), so the
copies run at the link's rate instead of through a pageable bounce buffer, back to back without
a host wait each, with one synchronisation at the end; the way back copies from that pinned
memory just as fast. torch's host caching allocator keeps the pinned blocks after onload and
hands them to the next offload, so only the first offload pays for pinning (and that much host
memory stays reserved by the process).

On a CPU trainer both are no-ops.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's shard on this rank
    return to_local() if to_local is not None else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _release_cached_memory() -> None:
    """Hand every block nothing references back to the driver, for the engines to use."""
    gc.collect()  # the moved-out GPU tensors can sit in reference cycles until the next collection
    # cuBLAS keeps a workspace per stream in the caching allocator (tens of MiB on Hopper); it is
    # allocated again at the next matmul. Private in torch, hence looked up, not required.
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


class Offloader:
    """Offload / onload for one :class:`miles_fsdp.rank.RankTrainer` (its ``offload`` and ``onload`` commands)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        # Optimizer state entries moved to the CPU by the last offload: (state dict, key).
        self._moved_state: list[tuple[dict[str, Any], str]] | None = None

    @property
    def offloaded(self) -> bool:
        return self._moved_state is not None

    def offload(self, _arg: Any = None) -> dict[str, float]:
        device = self.trainer.device
        if device.type != "cuda" or self.offloaded:
            return {"bytes": 0.0, "seconds": 0.0}
        start = time.perf_counter()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        pinned = self.trainer.opts.pin_offload
        cpu = torch.device("cpu")
        moved = sum(self._move_module(m, cpu, pinned) for m in self._modules())
        self._moved_state = []
        for optimizer in self._optimizers():
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                        moved += _nbytes(value)
                        state[key] = value.to(cpu, non_blocking=pinned)
                        self._moved_state.append((state, key))
        torch.cuda.synchronize(device)
        _release_cached_memory()
        return {
            "bytes": float(moved),
            "seconds": time.perf_counter() - start,
            "cuda_allocated_before": float(before),
            "cuda_allocated_after": float(torch.cuda.memory_allocated(device)),
        }

    def onload(self, _arg: Any = None) -> dict[str, float]:
        device = self.trainer.device
        if device.type != "cuda" or not self.offloaded:
            return {"bytes": 0.0, "seconds": 0.0}
        start = time.perf_counter()
        pinned = self.trainer.opts.pin_offload
        moved = sum(self._move_module(m, device, pinned) for m in self._modules())
        for state, key in self._moved_state or []:
            state[key] = state[key].to(device, non_blocking=pinned)
            moved += _nbytes(state[key])
        self._moved_state = None
        torch.cuda.synchronize(device)
        return {
            "bytes": float(moved),
            "seconds": time.perf_counter() - start,
            "cuda_allocated_after": float(torch.cuda.memory_allocated(device)),
        }

    # ------------------------------------------------------------------ parts

    def _modules(self) -> list[nn.Module]:
        t = self.trainer
        modules: list[nn.Module] = [part.model for part in t.parts]  # the policy, and the critic if any
        modules += list(t.scorers.values())  # frozen reference / teacher
        return modules

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [part.optimizer for part in self.trainer.parts]

    @staticmethod
    def _move_module(module: nn.Module, device: torch.device, non_blocking: bool) -> int:
        moved = 0
        for p in module.parameters():
            moved += _nbytes(p)
            if p.grad is not None:
                moved += _nbytes(p.grad)
        moved += sum(_nbytes(b) for b in module.buffers())
        module.to(device, non_blocking=non_blocking)
        return moved
