"""The built-in buffer: blocking put, each drop reason at its check point, retry vs discard, staleness."""

from __future__ import annotations

import threading
import time

import pytest

from miles.builtins.buffer import FifoBuffer, staleness
from miles.interfaces import BufferPolicy
from miles.types import Group, Prompt, Sample, Status


def group(index: int, versions: list[list[int]], status: Status = Status.COMPLETED, rewards=None) -> Group:
    prompt = Prompt(index=index, prompt=f"p{index}")
    samples = []
    for i, v in enumerate(versions):
        s = Sample(
            prompt=prompt, group_index=i, response_ids=[1] * len(v), weight_versions=list(v), status=status
        )
        s.reward = (rewards or [float(i)] * len(versions))[i]
        samples.append(s)
    return Group(prompt=prompt, samples=samples)


class Recorder:
    def __init__(self) -> None:
        self.recycled: list[int] = []
        self.dropped: list[tuple[int, str]] = []

    def policy(self, **kw) -> BufferPolicy:
        return BufferPolicy(
            recycle=lambda p: self.recycled.append(p.index),
            on_drop=lambda g, reason: self.dropped.append((g.prompt.index, reason)),
            **kw,
        )


def test_staleness_is_measured_from_the_oldest_token_of_any_trajectory():
    g = group(0, [[5, 5, 6], [6, 7, 7]])  # trajectories spanning several versions
    assert staleness(g, 7) == 2
    assert staleness(g, 5) == 0
    assert staleness(group(1, [[]]), 9) == 0  # no tokens: nothing to be stale


def test_put_blocks_while_full_and_take_frees_room():
    buf = FifoBuffer(BufferPolicy(capacity=2))
    buf.put(group(0, [[0]]))
    buf.put(group(1, [[0]]))
    done = threading.Event()
    t = threading.Thread(target=lambda: (buf.put(group(2, [[0]])), done.set()))
    t.start()
    assert not done.wait(0.3), "put returned although the buffer was full"
    assert [g.prompt.index for g in buf.take(1, weight_version=0)] == [0]
    assert done.wait(5), "put stayed blocked after take made room"
    t.join()
    assert [g.prompt.index for g in buf.take(5, weight_version=0)] == [1, 2]


def test_aborted_groups_are_dropped_on_arrival_and_retried_or_discarded():
    for retry, expect_recycled in ((True, [3]), (False, [])):
        rec = Recorder()
        buf = FifoBuffer(rec.policy(retry_aborted=retry))
        g = group(3, [[0], [0]])
        g.samples[1].status = Status.ABORTED
        buf.put(g)
        assert buf.take(1, weight_version=0) == []
        assert rec.recycled == expect_recycled
        assert rec.dropped == [(3, "aborted")]
        m = buf.metrics()
        assert m["aborted_groups_filtered"] == 1.0 and m["stale_groups_filtered"] == 0.0


def test_filter_rejections_are_always_discarded_on_arrival():
    rec = Recorder()
    buf = FifoBuffer(
        rec.policy(filters=[("nonzero_std", lambda g: len(set(g.rewards)) > 1)], retry_aborted=True)
    )
    buf.put(group(4, [[0], [0]], rewards=[1.0, 1.0]))
    buf.put(group(5, [[0], [0]], rewards=[0.0, 1.0]))
    assert [g.prompt.index for g in buf.take(2, weight_version=0)] == [5]
    assert rec.recycled == []  # no gradient signal: never retried
    assert rec.dropped == [(4, "filter:nonzero_std")]
    assert buf.metrics()["dropped/filter:nonzero_std"] == 1.0


def test_plugin_reject_runs_after_filters():
    rec = Recorder()
    buf = FifoBuffer(rec.policy(reject=lambda g: "too_short" if g.prompt.index == 6 else None))
    buf.put(group(6, [[0]]))
    assert rec.dropped == [(6, "filter:too_short")]


def test_staleness_is_checked_on_the_way_out_not_on_arrival():
    rec = Recorder()
    buf = FifoBuffer(rec.policy(max_staleness=1, retry_stale=True))
    buf.put(group(7, [[0, 1]]))  # fresh enough when it arrives at version 1
    buf.put(group(8, [[2]]))
    assert rec.dropped == []
    # The trainer moved on to version 2 while the groups waited: group 7 is now 2 versions old.
    assert [g.prompt.index for g in buf.take(1, weight_version=2)] == [8]
    assert rec.dropped == [(7, "stale")]
    assert rec.recycled == [7]
    m = buf.metrics()
    assert m["stale_groups_filtered"] == 1.0
    assert m["max_staleness"] == 0.0 and m["queue_size"] == 2.0


def test_stale_groups_can_be_discarded():
    rec = Recorder()
    buf = FifoBuffer(rec.policy(max_staleness=0, retry_stale=False))
    buf.put(group(9, [[0]]))
    assert buf.take(1, weight_version=1) == []
    assert rec.recycled == [] and rec.dropped == [(9, "stale")]


def test_metrics_report_drawn_and_waiting_staleness_per_window():
    buf = FifoBuffer(BufferPolicy(max_staleness=None))
    for i, v in enumerate([0, 1, 2, 3]):
        buf.put(group(i, [[v]]))
    buf.take(2, weight_version=3)  # draws versions 0 and 1 -> staleness 3 and 2
    m = buf.metrics()
    assert m["queue_size"] == 4.0
    assert m["avg_staleness"] == 2.5 and m["max_staleness"] == 3.0
    assert m["buffer_avg_staleness"] == 0.5 and m["buffer_max_staleness"] == 1.0
    again = buf.metrics()  # a new window: nothing drawn since
    assert again["avg_staleness"] == 0.0 and again["queue_size"] == 2.0


def test_take_waits_for_groups_up_to_its_timeout():
    buf = FifoBuffer(BufferPolicy())
    threading.Timer(0.2, lambda: buf.put(group(1, [[0]]))).start()
    t0 = time.monotonic()
    got = buf.take(1, weight_version=0, timeout_s=5.0)
    assert [g.prompt.index for g in got] == [1] and time.monotonic() - t0 < 4
    t0 = time.monotonic()
    assert buf.take(1, weight_version=0, timeout_s=0.2) == []
    assert time.monotonic() - t0 >= 0.19


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        FifoBuffer(BufferPolicy(capacity=0))
