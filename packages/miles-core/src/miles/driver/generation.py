"""The rollout stage: prompts -> trajectory groups -> filters -> buffer -> a training batch."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from miles.driver.components import Components
from miles.interfaces import RolloutContext
from miles.types import Group, Sample, Status


class RolloutStage:
    """Fills the buffer with ``prompts_per_step`` groups that pass the filters, then takes them.

    Drop reasons are checked on arrival: a group with an aborted trajectory goes back to
    the data source (retried, never lost); a group a filter rejects is discarded.
    """

    def __init__(
        self,
        components: Components,
        ctx: RolloutContext,
        *,
        prompts_per_step: int,
        max_rounds: int,
        hooks: Any,
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
        t0 = time.perf_counter()
        generated: list[Group] = []
        dropped: dict[str, int] = {}
        for _ in range(self.max_rounds):
            need = self.prompts_per_step - len(self.c.buffer)  # type: ignore[arg-type]
            if need <= 0:
                break
            prompts = self.c.data_source.next_prompts(need)
            if on_round_start is not None:
                on_round_start(len(prompts) * self.ctx.n_samples_per_prompt)
            groups = self.loop.run_until_complete(self.c.rollout_fn(self.ctx, prompts))
            self.hooks.miles_rollout_postprocess(groups=groups, step=step)
            generated.extend(groups)
            for group in groups:
                reason = self._drop_reason(group)
                if reason is None:
                    self.c.buffer.put(group)
                    continue
                dropped[reason] = dropped.get(reason, 0) + 1
                if reason == "aborted":
                    self.c.data_source.put_back([group.prompt])
                self.hooks.miles_on_group_dropped(group=group, reason=reason)
        batch = self.c.buffer.take(self.prompts_per_step)
        elapsed = time.perf_counter() - t0
        return batch, rollout_metrics(generated, batch, dropped, elapsed)

    def _drop_reason(self, group: Group) -> str | None:
        if any(s.status is Status.ABORTED for s in group.samples):
            return "aborted"
        for name, keep in self.c.filters:
            if not keep(group):
                return f"filter:{name}"
        return self.hooks.miles_buffer_reject(group=group)


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
    for reason, n in dropped.items():
        metrics[f"rollout/dropped/{reason}"] = float(n)
    if kept:
        metrics["rollout/kept_reward_mean"] = statistics.fmean(
            s.reward or 0.0 for g in kept for s in g.samples
        )
    return metrics
