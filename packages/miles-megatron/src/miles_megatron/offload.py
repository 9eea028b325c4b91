"""Move a trainer's device state to pinned host memory and back, storage by storage.

Megatron keeps gradients (and, with the distributed optimizer, parameters) as views into
contiguous buffers, so moving tensors one by one would break the views. Instead each distinct
storage behind the given tensors is copied out whole and then resized to zero bytes; onload
resizes it back and copies the bytes in. Every view stays valid and every value comes back
bit for bit. Nothing may use the tensors in between.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch


class StorageOffloader:
    """Offload / onload of the storages behind ``tensors`` (those on ``device`` only)."""

    def __init__(self, tensors: Iterable[torch.Tensor], device: torch.device | str) -> None:
        device = torch.device(device)
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t is None or t.device.type != device.type:
                continue
            s = t.untyped_storage()
            if s.nbytes() > 0:
                seen.setdefault(s.data_ptr(), s)
        self.storages = list(seen.values())
        self.device = device
        self._host: list[torch.Tensor] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._host)

    def offload(self) -> dict[str, float]:
        if self._host:
            raise RuntimeError("already offloaded")
        t0 = time.perf_counter()
        pin = self.device.type == "cuda"
        moved = 0
        for s in self.storages:
            view = torch.empty(0, dtype=torch.uint8, device=self.device).set_(s)
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(view)
            self._host.append(host)
            moved += s.nbytes()
        if pin:
            torch.cuda.synchronize(self.device)
        for s in self.storages:
            s.resize_(0)
        if pin:
            torch.cuda.empty_cache()
        return {"bytes": float(moved), "seconds": time.perf_counter() - t0}

    def onload(self) -> dict[str, float]:
        if not self._host:
            raise RuntimeError("not offloaded")
        t0 = time.perf_counter()
        moved = 0
        for s, host in zip(self.storages, self._host, strict=True):
            s.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=self.device).set_(s).copy_(host, non_blocking=True)
            moved += host.numel()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._host = []
        return {"bytes": float(moved), "seconds": time.perf_counter() - t0}
