"""The synchronous rollout stage: prompts -> trajectory groups -> buffer -> a training batch."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles.driver.components import Components
from miles.interfaces import RolloutContext
from miles.types import Group, Sample, Status

if TYPE_CHECKING:
    from miles.driver.hooks import Hooks


class DropLog:
    """Counts the groups the buffer drops, by reason, and reports each to the plugins.

    The buffer calls ``record`` from whichever thread saw the drop (the rollout worker's
    for arrivals, the driver's for staleness); ``drain`` hands the driver the counts since
    its last call.
    """

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def record(self, group: Group, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
        self.hooks.miles_on_group_dropped(group=group, reason=reason)

    def drain(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


class RolloutStage:
    """Generates ``prompts_per_step`` groups that the buffer keeps, then takes them.

    The buffer applies the drop rules (aborted groups go back to the data source, a
    group a filter rejects is discarded); up to ``max_rounds`` rounds refill what it dropped.
    """

    def __init__(
        self,
        components: Components,
        ctx: RolloutContext,
        *,
        prompts_per_step: int,
        max_rounds: int,
        hooks: Hooks,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.c = components
        self.ctx = ctx
        self.prompts_per_step = prompts_per_step
        self.max_rounds = max_rounds
        self.hooks = hooks
        self.loop = loop

    def run(
        self, step: int, on_round_start: Callable[[int], None] | None = None
    ) -> tuple[list[Group], dict[str, float]]:
        self.ctx.step = step
        self.ctx.served_version = step
        t0 = time.perf_counter()
        generated: list[Group] = []
        batch: list[Group] = []
        for _ in range(self.max_rounds):
            need = self.prompts_per_step - len(batch)
            if need <= 0:
                break
            prompts = self.c.data_source.next_prompts(need)
            if on_round_start is not None:
                on_round_start(len(prompts) * self.ctx.n_samples_per_prompt)
            groups = self.loop.run_until_complete(self.c.rollout_fn(self.ctx, prompts))
            self.hooks.miles_rollout_postprocess(groups=groups, step=step)
            generated.extend(groups)
            for group in groups:
                self.c.buffer.put(group)
            batch.extend(self.c.buffer.take(need, weight_version=step))
        elapsed = time.perf_counter() - t0
        return batch, rollout_metrics(generated, batch, self.c.drops.drain(), elapsed)


class SyncGeneration:
    """The synchronous schedule as the driver sees it: generate a batch now; weights change between steps."""

    def __init__(self, stage: RolloutStage, console: Any = None) -> None:
        self.stage = stage
        self.console = console

    def collect(self, step: int) -> tuple[list[Group], dict[str, float]]:
        bar = None if self.console is None else (lambda total: self.console.start_rollout(step, total))
        groups, metrics = self.stage.run(step, on_round_start=bar)
        metrics |= {f"buffer/{k}": v for k, v in self.stage.c.buffer.metrics().items()}
        return groups, metrics

    def weights_changing(self, version: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the engines are idle between steps

    def close(self) -> None:
        pass


def rollout_metrics(
    generated: list[Group], kept: list[Group], dropped: dict[str, int], seconds: float
) -> dict[str, float]:
    samples: list[Sample] = [s for g in generated for s in g.samples]
    rewards = [s.reward or 0.0 for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    tokens = sum(lengths)
    metrics = {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/full_reward_frac": (sum(r >= 1.0 for r in rewards) / len(rewards)) if rewards else 0.0,
        "rollout/response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/truncated_frac": (sum(s.status is Status.TRUNCATED for s in samples) / len(samples))
        if samples
        else 0.0,
        "rollout/samples": float(len(samples)),
        "rollout/groups_kept": float(len(kept)),
        "rollout/groups_dropped": float(sum(dropped.values())),
        "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "time/rollout_s": seconds,
    }
    metrics |= episode_metrics(samples)
    for reason, n in dropped.items():
        metrics[f"rollout/dropped/{reason}"] = float(n)
    if kept:
        metrics["rollout/kept_reward_mean"] = statistics.fmean(
            s.reward or 0.0 for g in kept for s in g.samples
        )
    return metrics


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """Multi-turn episodes (samples assembled from sessions): turns, tool calls, the share of
    prompt tokens the engines' prefix caches served (what session affinity saves), exit-reason
    counts (``rollout/exit/<reason>``) and the tool time agents report (``tool_time_s``)."""
    metrics: dict[str, float] = {}
    # Why episodes ended (agents that report an exit reason): rollout/exit/<reason>, per step.
    for sample in samples:
        reason = sample.metadata.get("exit_reason")
        if isinstance(reason, str):
            key = f"rollout/exit/{reason}"
            metrics[key] = metrics.get(key, 0.0) + 1.0
    tool_times = [t for s in samples if isinstance(t := s.metadata.get("tool_time_s"), int | float)]
    if tool_times:
        metrics["rollout/episode/tool_time_s_mean"] = statistics.fmean(tool_times)
        metrics["rollout/episode/tool_time_s_total"] = float(sum(tool_times))
    episodes = [s for s in samples if "turns" in s.metadata]
    if not episodes:
        return metrics
    metrics |= {
        "rollout/episode/turns_mean": statistics.fmean(s.metadata["turns"] for s in episodes),
        "rollout/episode/tool_calls_mean": statistics.fmean(
            s.metadata.get("tool_calls", 0) for s in episodes
        ),
    }
    prompt = sum(s.metadata.get("prompt_tokens", 0) for s in episodes)
    if prompt:
        metrics["rollout/episode/cached_prompt_frac"] = (
            sum(s.metadata.get("cached_tokens", 0) for s in episodes) / prompt
        )
    return metrics
