"""The built-in buffer: first in, first out, with optional capacity."""

from __future__ import annotations

import threading
from collections import deque

from miles.types import Group


class FifoBuffer:
    """Groups wait here between generation and training.

    ``put`` blocks while the buffer holds ``capacity`` groups (``None``: unbounded,
    which is what the synchronous loop uses); ``take`` returns up to ``n_groups``.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity
        self._groups: deque[Group] = deque()
        self._cond = threading.Condition()
        self._put_total = 0
        self._taken_total = 0

    def put(self, group: Group) -> None:
        with self._cond:
            while self.capacity is not None and len(self._groups) >= self.capacity:
                self._cond.wait()
            self._groups.append(group)
            self._put_total += 1
            self._cond.notify_all()

    def take(self, n_groups: int) -> list[Group]:
        with self._cond:
            out = [self._groups.popleft() for _ in range(min(n_groups, len(self._groups)))]
            self._taken_total += len(out)
            self._cond.notify_all()
            return out

    def __len__(self) -> int:
        return len(self._groups)

    def metrics(self) -> dict[str, float]:
        return {
            "buffer/size": float(len(self._groups)),
            "buffer/put_total": float(self._put_total),
            "buffer/taken_total": float(self._taken_total),
        }
