"""A generate function whose episodes take a heavy-tailed time, like tool-using agent episodes.

Each trajectory samples a short completion from the engine, then waits for its
"environment" for a latency drawn from a log-normal distribution (seeded by prompt,
sample and attempt, so both schedules see the same latencies for every first attempt). Most
episodes are quick; a few per batch take an order of magnitude longer: the stragglers a
synchronous step must wait for.

Options (``rollout.options``): ``latency_median_s`` (0.15), ``latency_sigma`` (1.2).
"""

from __future__ import annotations

import asyncio
import math
import random
import time

from miles.builtins.rollout.generate import single_turn_generate
from miles.interfaces import RolloutContext
from miles.types import Sample

_attempts: dict[tuple[int, int], int] = {}


def episode_latency(prompt_index: int, sample_index: int, median_s: float, sigma: float) -> float:
    """Seeded by prompt, sample and attempt: a retried prompt draws a fresh latency (as a real
    environment would), while both schedules see the same draws for every first attempt."""
    attempt = _attempts.get((prompt_index, sample_index), 0)
    _attempts[(prompt_index, sample_index)] = attempt + 1
    rng = random.Random((prompt_index * 1009 + sample_index) * 7919 + attempt)
    return median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


def reset_attempts() -> None:
    _attempts.clear()


async def heavy_tail_generate(ctx: RolloutContext, sample: Sample) -> Sample:
    t0 = time.perf_counter()
    await single_turn_generate(ctx, sample)
    latency = episode_latency(
        sample.prompt.index,
        sample.group_index,
        float(ctx.options.get("latency_median_s", 0.15)),
        float(ctx.options.get("latency_sigma", 1.2)),
    )
    await asyncio.sleep(latency)
    sample.metadata["env_latency_s"] = latency
    sample.metadata["episode_s"] = time.perf_counter() - t0
    return sample
