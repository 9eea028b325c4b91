"""The fully asynchronous rollout worker: both replacement rules, backpressure, pausing, failures."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.builtins.buffer import FifoBuffer
from miles.driver.async_rollout import AsyncRolloutWorker, RolloutWorkerError, Slots
from miles.interfaces import BufferPolicy, RolloutContext
from miles.types import Group, Prompt, Sample, SamplingParams, Status

N = 4  # trajectories per group


class ListSource:
    """An endless prompt source (indices count up), with put_back like the real ones."""

    def __init__(self) -> None:
        self.next_index = 0
        self.returned: list[Prompt] = []

    def next_prompts(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.returned:
                out.append(self.returned.pop(0))
            else:
                out.append(Prompt(index=self.next_index, prompt="x"))
                self.next_index += 1
        return out

    def put_back(self, prompts) -> None:
        self.returned.extend(prompts)

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        pass

    def __len__(self) -> int:
        return 10**9


class TimedRollout:
    """Trajectory (prompt, i) takes durations.get((prompt, i), fast) seconds; records concurrency."""

    def __init__(
        self, durations: dict[tuple[int, int], float], fast: float = 0.02, fail_on: int | None = None
    ):
        self.durations = durations
        self.fast = fast
        self.fail_on = fail_on
        self.active = 0
        self.max_active = 0
        self.started: list[tuple[float, int]] = []  # (time, prompt index) of each group start
        self.finished_at: dict[int, float] = {}

    async def __call__(self, ctx: RolloutContext, prompts: list[Prompt]) -> list[Group]:
        (prompt,) = prompts
        if prompt.index == self.fail_on:
            raise RuntimeError("environment exploded")
        self.started.append((time.monotonic(), prompt.index))
        samples = [Sample(prompt=prompt, group_index=i) for i in range(ctx.n_samples_per_prompt)]

        async def one(s: Sample) -> None:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            await asyncio.sleep(self.durations.get((prompt.index, s.group_index), self.fast))
            s.response_ids, s.rollout_logprobs, s.loss_mask = [1], [0.0], [1]
            s.weight_versions = [ctx.served_version or 0]
            s.status, s.reward = Status.COMPLETED, float(s.group_index)
            self.active -= 1
            ctx.on_generation_done(s)

        await asyncio.gather(*(one(s) for s in samples))
        self.finished_at[prompt.index] = time.monotonic()
        return [Group(prompt=prompt, samples=samples)]


def make_worker(rollout, *, replacement: str, max_inflight: int = 8, capacity: int | None = None):
    source = ListSource()
    buffer = FifoBuffer(BufferPolicy(capacity=capacity, recycle=lambda p: source.put_back([p])))

    def context() -> RolloutContext:
        return RolloutContext(
            engines=[],
            tokenizer=None,
            sampling=SamplingParams(),
            n_samples_per_prompt=N,
            reward=lambda s: 0.0,
        )

    worker = AsyncRolloutWorker(
        rollout, context, source, buffer, max_inflight=max_inflight, replacement=replacement
    )
    return worker, buffer, source


class EveryGroupStraggles(TimedRollout):
    """Trajectory 1 of every group is slow; the others are fast."""

    def __init__(self) -> None:
        super().__init__({})

    async def __call__(self, ctx, prompts):
        self.durations[(prompts[0].index, 1)] = 0.3
        return await super().__call__(ctx, prompts)


def groups_finished_in(replacement: str, seconds: float = 1.5) -> tuple[int, TimedRollout]:
    rollout = EveryGroupStraggles()
    worker, _buffer, _ = make_worker(rollout, replacement=replacement, capacity=1000)
    worker.start()
    try:
        time.sleep(seconds)
        return len(rollout.finished_at), rollout
    finally:
        worker.stop()


def test_sample_granularity_keeps_generating_past_stragglers():
    by_sample, r_sample = groups_finished_in("sample")
    by_group, r_group = groups_finished_in("group")
    # Group rule: each group holds all 4 places for its straggler's 0.3 s (2 groups per 0.3 s).
    # Sample rule: fast trajectories' places are reused at once, so 4-5 stragglers overlap.
    assert by_sample > 1.4 * by_group, (by_sample, by_group)
    for r in (r_sample, r_group):
        assert r.max_active <= 8, "more trajectories in flight than max_inflight"


def test_full_buffer_stops_new_groups():
    rollout = TimedRollout({})
    worker, buffer, _ = make_worker(rollout, replacement="sample", capacity=2)
    worker.start()
    try:
        time.sleep(0.6)
        started = len(rollout.started)
        # 2 in the buffer, at most one blocked put, and the groups that were in flight: nothing more.
        assert started <= 2 + 1 + 2, started
        assert len(buffer) == 2
        time.sleep(0.3)
        assert len(rollout.started) == started, "groups kept starting although the buffer was full"
        # Finished groups waiting for room go in first; only then does a new group start.
        deadline = time.monotonic() + 5
        while len(rollout.started) == started and time.monotonic() < deadline:
            buffer.take(2, weight_version=0)
            time.sleep(0.05)
        assert len(rollout.started) > started, "taking from the buffer did not restart generation"
    finally:
        worker.stop()


def test_pause_production_stops_new_groups_but_lets_inflight_finish():
    rollout = TimedRollout({}, fast=0.1)
    worker, _buffer, _ = make_worker(rollout, replacement="sample", capacity=1000)
    worker.start()
    try:
        time.sleep(0.3)
        with worker.pause_production():
            time.sleep(0.15)  # in-flight ones finish
            started = len(rollout.started)
            time.sleep(0.4)
            assert len(rollout.started) == started
            assert rollout.active == 0
        deadline = time.monotonic() + 5
        while len(rollout.started) == started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(rollout.started) > started
    finally:
        worker.stop()


def test_worker_failure_surfaces_with_its_traceback():
    worker, _, _ = make_worker(TimedRollout({}, fail_on=3), replacement="group")
    worker.start()
    deadline = time.monotonic() + 5
    with pytest.raises(RolloutWorkerError, match="environment exploded"):
        while time.monotonic() < deadline:
            worker.check()
            time.sleep(0.02)
    worker.stop()


def test_slots_refuse_a_limit_below_one_group():
    with pytest.raises(ValueError, match="at least"):
        Slots(capacity=1, group_size=2)


_BLOCKED_AT_EXIT = """
import sys, time
sys.path.insert(0, {tests!r})
from driver.test_async_worker import TimedRollout, make_worker
worker, buffer, _ = make_worker(TimedRollout({{}}), replacement="sample", capacity=1)
worker.start()
while len(buffer) < 1:
    time.sleep(0.02)
time.sleep(0.3)  # the next finished group is now blocked in put: the buffer holds 1 and nobody takes
worker.stop()
print("stopped", flush=True)
"""


def test_a_put_blocked_at_shutdown_does_not_keep_the_process_alive():
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_AT_EXIT.format(tests=tests)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "stopped" in proc.stdout, proc.stderr[-2000:]
