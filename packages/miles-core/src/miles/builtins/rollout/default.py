"""The built-in rollout function: ``n_samples_per_prompt`` trajectories per prompt, rewarded."""

from __future__ import annotations

import asyncio
import inspect

from miles.builtins.rollout.prompts import render_prompt_ids
from miles.interfaces import GenerateFn, RolloutContext
from miles.plugins import load_component
from miles.types import Group, Prompt, Sample, Status


class GroupRollout:
    """Runs every trajectory of a rollout concurrently (the engines batch them) and scores each.

    ``generate_fn`` names the layer below (a generate function by name or import path),
    so a multi-turn or agentic generate function replaces exactly that layer.
    """

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
        await asyncio.gather(*(self._run_one(ctx, s) for g in groups for s in g.samples))
        return groups

    async def _run_one(self, ctx: RolloutContext, sample: Sample) -> None:
        await self.generate(ctx, sample)
        sample.check_aligned()
        if sample.status is not Status.ABORTED:
            try:
                reward = ctx.reward(sample)
                if inspect.isawaitable(reward):
                    reward = await reward
                sample.reward = float(reward)
            except Exception as exc:  # a broken reward marks the sample, it does not kill the run
                sample.status = Status.FAILED
                sample.reward = 0.0
                sample.metadata["reward_error"] = f"{type(exc).__name__}: {exc}"
        if ctx.on_sample_done is not None:
            ctx.on_sample_done(sample)
