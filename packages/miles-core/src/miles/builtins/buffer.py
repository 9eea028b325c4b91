"""The built-in buffer: first in, first out, bounded, dropping groups for the three reasons.

Where each reason is checked follows from what it depends on. Aborted generation and
a filter's verdict are properties of the group, so they are checked once, on arrival.
Staleness grows while a group waits (the trainer keeps updating its weights), so it is
checked on the way out, against the version the trainer holds at that moment.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

from miles.interfaces import DROP_ABORTED, DROP_FILTER_PREFIX, DROP_STALE, BufferPolicy
from miles.types import Group, Status


def staleness(group: Group, weight_version: int) -> int:
    """Current version minus the oldest version of any token in the group (0 if it has none)."""
    oldest = group.oldest_weight_version
    return 0 if oldest is None else max(weight_version - oldest, 0)


class FifoBuffer:
    """Groups wait here between generation and training, oldest first."""

    def __init__(self, policy: BufferPolicy | None = None) -> None:
        self.policy = policy or BufferPolicy()
        if self.policy.capacity is not None and self.policy.capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 or None, got {self.policy.capacity}")
        self._groups: deque[Group] = deque()
        self._cond = threading.Condition()
        self._put_total = 0
        self._taken_total = 0
        # Per-window figures, reset by metrics(): what the steps since the last report drew and dropped.
        self._drawn_staleness: list[int] = []
        self._queue_size_at_take: int | None = None
        self._last_version: int | None = None
        self._dropped: dict[str, int] = {}

    # ------------------------------------------------------------------- put

    def put(self, group: Group) -> None:
        reason = self._arrival_reason(group)
        if reason is not None:
            self._drop(group, reason, retry=reason == DROP_ABORTED and self.policy.retry_aborted)
            return
        with self._cond:
            while self.policy.capacity is not None and len(self._groups) >= self.policy.capacity:
                self._cond.wait()
            self._groups.append(group)
            self._put_total += 1
            self._cond.notify_all()

    def _arrival_reason(self, group: Group) -> str | None:
        if any(s.status is Status.ABORTED for s in group.samples):
            return DROP_ABORTED
        for name, keep in self.policy.filters:
            if not keep(group):
                return f"{DROP_FILTER_PREFIX}{name}"
        if self.policy.reject is not None and (reason := self.policy.reject(group)) is not None:
            return f"{DROP_FILTER_PREFIX}{reason}"
        return None

    # ------------------------------------------------------------------ take

    def take(self, n_groups: int, weight_version: int, timeout_s: float | None = None) -> list[Group]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out: list[Group] = []
        stale: list[Group] = []
        with self._cond:
            self._last_version = weight_version
            if self._queue_size_at_take is None:
                self._queue_size_at_take = len(self._groups)
            while len(out) < n_groups:
                if not self._groups:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is None or remaining <= 0:
                        break
                    self._cond.wait(remaining)
                    continue
                group = self._groups.popleft()
                age = staleness(group, weight_version)
                if self.policy.max_staleness is not None and age > self.policy.max_staleness:
                    stale.append(group)
                    continue
                out.append(group)
                self._drawn_staleness.append(age)
            self._taken_total += len(out)
            self._cond.notify_all()  # room for blocked puts
        for group in stale:  # outside the lock: recycling talks to the data source
            self._drop(group, DROP_STALE, retry=self.policy.retry_stale)
        return out

    # --------------------------------------------------------------- metrics

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def metrics(self) -> dict[str, float]:
        with self._cond:
            version = self._last_version
            waiting = [staleness(g, version) for g in self._groups] if version is not None else []
            drawn, self._drawn_staleness = self._drawn_staleness, []
            queue_size = (
                self._queue_size_at_take if self._queue_size_at_take is not None else len(self._groups)
            )
            self._queue_size_at_take = None
            dropped, self._dropped = self._dropped, {}
        metrics = {
            "queue_size": float(queue_size),
            "avg_staleness": statistics.fmean(drawn) if drawn else 0.0,
            "max_staleness": float(max(drawn, default=0)),
            "buffer_avg_staleness": statistics.fmean(waiting) if waiting else 0.0,
            "buffer_max_staleness": float(max(waiting, default=0)),
            "aborted_groups_filtered": float(dropped.pop(DROP_ABORTED, 0)),
            "stale_groups_filtered": float(dropped.pop(DROP_STALE, 0)),
            "put_total": float(self._put_total),
            "taken_total": float(self._taken_total),
        }
        for reason, n in dropped.items():
            metrics[f"dropped/{reason}"] = float(n)
        return metrics

    # ------------------------------------------------------------------ drops

    def _drop(self, group: Group, reason: str, *, retry: bool) -> None:
        with self._cond:
            self._dropped[reason] = self._dropped.get(reason, 0) + 1
        if retry and self.policy.recycle is not None:
            self.policy.recycle(group.prompt)
        if self.policy.on_drop is not None:
            self.policy.on_drop(group, reason)
