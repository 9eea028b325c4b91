"""The built-in rollout function: ``n_samples_per_prompt`` trajectories per prompt, rewarded."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING, Any, cast

from miles.builtins.rollout.prompts import render_prompt_ids
from miles.capabilities import NoOptions
from miles.interfaces import GenerateFn, RolloutContext
from miles.plugins import load_component
from miles.tracking.timing import add_busy
from miles.types import Group, Prompt, Sample, Status

if TYPE_CHECKING:
    from miles.interfaces import GroupRewardFn


def is_group_reward(reward: Any) -> bool:
    """A group reward is marked with a true ``group_reward`` attribute (see ``GroupRewardFn``)."""
    return bool(getattr(reward, "group_reward", False))


class GroupRollout:
    """Runs every trajectory of a rollout concurrently (the engines batch them) and scores each.

    Per trajectory: generate, then the context's scorers (e.g. a served teacher), then the
    reward. A per-sample reward runs as soon as its trajectory ends; a group reward runs
    once the whole group has ended, on the samples that were not aborted. The reward
    post-processors then reshape each reward in order. A reward that raises marks its
    samples FAILED with reward 0 rather than ending the run; so does a scorer or a
    post-processor that raises. A trajectory the generate layer marked FAILED gets no reward.

    ``generate_fn`` names the layer below (a generate function by name or import path),
    so a multi-turn generate function (a plugin's) replaces exactly that layer.
    It reads no ``rollout.options`` (``Options``); a generate function may.
    """

    Options = NoOptions

    def __init__(self, generate_fn: str = "default") -> None:
        self.generate: GenerateFn = load_component("generate", generate_fn)

    async def __call__(self, ctx: RolloutContext, prompts: list[Prompt]) -> list[Group]:
        groups = []
        for prompt in prompts:
            prompt_ids = render_prompt_ids(ctx.tokenizer, prompt)
            samples = [
                Sample(prompt=prompt, group_index=i, prompt_ids=list(prompt_ids))
                for i in range(ctx.n_samples_per_prompt)
            ]
            groups.append(Group(prompt=prompt, samples=samples))
        await asyncio.gather(*(self._run_group(ctx, g) for g in groups))
        return groups

    async def _run_group(self, ctx: RolloutContext, group: Group) -> None:
        per_sample = not is_group_reward(ctx.reward)
        results = await asyncio.gather(*(self._run_one(ctx, s, reward=per_sample) for s in group.samples))
        # A generate function may return several samples for one attempt (a branching session's
        # leaves); they take that attempt's place in the group, in order.
        group.samples = [s for produced in results for s in produced]
        for i, sample in enumerate(group.samples):
            sample.group_index = i
        if not per_sample:
            await self._group_reward(ctx, [s for s in group.samples if s.status is not Status.ABORTED])
        for sample in group.samples:
            if sample.reward is not None and sample.status is not Status.FAILED:
                try:
                    for post in ctx.reward_postprocess:
                        sample.reward = float(post(sample, sample.reward))
                except Exception as exc:
                    _fail([sample], "reward_postprocess_error", exc)
            if ctx.on_sample_done is not None:
                ctx.on_sample_done(sample)

    async def _run_one(self, ctx: RolloutContext, slot: Sample, *, reward: bool) -> list[Sample]:
        produced = await self.generate(ctx, slot)
        samples = _as_samples(produced, slot)
        if ctx.on_generation_done is not None:
            ctx.on_generation_done(slot)
        await asyncio.gather(*(self._score_one(ctx, s, reward=reward) for s in samples))
        return samples

    async def _score_one(self, ctx: RolloutContext, sample: Sample, *, reward: bool) -> None:
        sample.check_aligned()
        if sample.status in (Status.ABORTED, Status.FAILED):
            return
        try:
            for scorer in ctx.scorers:
                await scorer(ctx, sample)
            sample.check_aligned()
        except Exception as exc:
            _fail([sample], "scorer_error", exc)
            return
        if reward:
            t0 = time.perf_counter()
            try:
                value = ctx.reward(sample)
                if inspect.isawaitable(value):
                    value = await value
                sample.reward = float(value)
            except Exception as exc:
                _fail([sample], "reward_error", exc)
            # Busy time, not a phase: rewards interleave with other samples' generation.
            add_busy("rollout/reward", time.perf_counter() - t0)

    async def _group_reward(self, ctx: RolloutContext, samples: list[Sample]) -> None:
        samples = [s for s in samples if s.status is not Status.FAILED]
        if not samples:
            return
        try:
            # ctx.reward is a GroupRewardFn here: the rollout checked is_group_reward(ctx.reward).
            group_reward = cast("GroupRewardFn", ctx.reward)
            t0 = time.perf_counter()
            produced = group_reward(samples)
            if inspect.isawaitable(produced):
                produced = await produced
            add_busy("rollout/reward", time.perf_counter() - t0)
            values = [float(v) for v in produced]
            if len(values) != len(samples):
                raise ValueError(f"group reward returned {len(values)} rewards for {len(samples)} samples")
        except Exception as exc:
            _fail(samples, "reward_error", exc)
            return
        for sample, value in zip(samples, values, strict=True):
            sample.reward = value


def _as_samples(produced: Sample | list[Sample] | None, slot: Sample) -> list[Sample]:
    """What a generate function returned, as a non-empty list (None: it filled ``slot`` in place)."""
    if produced is None:
        return [slot]
    if isinstance(produced, Sample):
        return [produced]
    samples = list(produced)
    if not samples or not all(isinstance(s, Sample) for s in samples):
        raise TypeError(
            "a generate function must return a Sample or a non-empty list of Samples, "
            f"got {type(produced).__name__} {produced!r:.80}"
        )
    return samples


def _fail(samples: list[Sample], key: str, exc: Exception) -> None:
    for sample in samples:
        sample.status = Status.FAILED
        sample.reward = 0.0
        sample.metadata[key] = f"{type(exc).__name__}: {exc}"
