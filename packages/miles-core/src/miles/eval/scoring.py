"""The evaluation itself: the eval prompts through the built-in rollout on some engines, scored by a reward.

Every mode ends here; they differ only in which engines serve the weights and how
those weights got there. The score is the mean reward; the pass rate counts rewards of
at least 1 (a fully correct answer for the built-in rewards).
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import Any

from miles.config.schema import DataSection, MilesConfig
from miles.errors import DataError
from miles.eval.result import ENGINE_ERROR, EvalSkipped
from miles.eval.versions import VersionStats, version_stats
from miles.interfaces import EngineClient, RewardFn, RolloutContext, RolloutFn
from miles.types import Prompt, Sample, SamplingParams, Status


@dataclass
class EvalScore:
    """What one pass over the eval prompts measured."""

    metrics: dict[str, float]
    versions: VersionStats
    aborted: int  # samples the engine gave up on: the score would leave them out silently
    samples: list[Sample] = field(default_factory=list, repr=False)

    def check(self, version: int) -> None:
        """Raise ``EvalSkipped`` unless the score is a complete measurement of ``version``."""
        try:
            self.versions.check(version)
        except EvalSkipped as skip:
            skip.metrics = dict(self.metrics)
            raise
        if self.aborted:
            raise EvalSkipped(
                ENGINE_ERROR,
                f"the engines aborted {self.aborted} of {len(self.samples)} eval samples",
                metrics=self.metrics,
                mean_weight_version=self.versions.mean_weight_version,
                mixed_version_fraction=self.versions.mixed_version_fraction,
            )


@dataclass
class EvalSet:
    """The eval prompts and how to sample and score them; the same prompts at every evaluation."""

    prompts: list[Prompt]
    tokenizer: Any
    reward: RewardFn
    sampling: SamplingParams
    n_samples_per_prompt: int
    rollout: RolloutFn
    options: dict[str, Any] = field(default_factory=dict)  # the rollout options (generate layers read them)
    # The run's rollout services (RolloutContext.services), so a generate layer that uses one finds it.
    services: dict[str, Any] = field(default_factory=dict)

    async def score(self, engines: list[EngineClient], version: int) -> EvalScore:
        """Run every eval prompt on ``engines`` (spread over them) and score the result as ``version``."""
        if not engines:
            raise EvalSkipped(ENGINE_ERROR, "no engines to evaluate on")
        ctx = RolloutContext(
            engines=list(engines),
            tokenizer=self.tokenizer,
            sampling=self.sampling,
            n_samples_per_prompt=self.n_samples_per_prompt,
            reward=self.reward,
            options=dict(self.options),
            services=dict(self.services),
        )
        # Copies: a generate layer may annotate its prompt, and the next evaluation must see the same set.
        groups = await self.rollout(ctx, copy.deepcopy(self.prompts))
        samples = [s for g in groups for s in g.samples]
        return EvalScore(
            metrics=summarize(samples),
            versions=version_stats(samples, version),
            aborted=sum(s.status is Status.ABORTED for s in samples),
            samples=samples,
        )

    async def aclose(self) -> None:
        """Close what the reward holds open (a remote reward's HTTP session) in the loop that used it."""
        close = getattr(self.reward, "aclose", None)
        if close is not None:
            await close()


def summarize(samples: list[Sample]) -> dict[str, float]:
    rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    return {
        "score": statistics.fmean(rewards) if rewards else 0.0,
        "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else 0.0,
        "n_samples": float(len(samples)),
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "truncated_frac": sum(s.status is Status.TRUNCATED for s in samples) / len(samples)
        if samples
        else 0.0,
        "failed": float(sum(s.status is Status.FAILED for s in samples)),
        "aborted": float(sum(s.status is Status.ABORTED for s in samples)),
    }


def build_eval_set(
    *,
    data: DataSection,
    tokenizer: Any,
    reward: str,
    reward_options: dict[str, Any],
    max_prompts: int | None,
    n_samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float,
    generate_fn: str = "default",
    rollout_options: dict[str, Any] | None = None,
) -> EvalSet:
    """Resolve the data source, reward and generate layer now, so a bad name fails before any work."""
    from miles.builtins.rollout.default import GroupRollout
    from miles.plugins import make_component

    source = make_component("data_source", data.source, data.model_dump(exclude={"source"}))
    total = len(source)
    n = total if max_prompts is None else min(max_prompts, total)
    if n < 1:
        raise DataError(f"eval data {data.path!r} holds no prompts")
    return EvalSet(
        prompts=source.next_prompts(n),
        tokenizer=tokenizer,
        reward=make_component("reward", reward, reward_options),
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature),
        n_samples_per_prompt=n_samples_per_prompt,
        rollout=GroupRollout(generate_fn=generate_fn),
        options=dict(rollout_options or {}),
    )


def eval_set_from_config(
    config: MilesConfig, tokenizer: Any, services: dict[str, Any] | None = None
) -> EvalSet:
    """The run's eval set: ``eval.data`` sampled per the ``eval`` section, the run's generate layer
    (with ``services``, the run's rollout services, for a generate layer that uses one).

    The reward is ``eval.reward`` (default: the training reward, with its options unless
    ``eval.reward_options`` gives others).
    """
    ev = config.eval
    if ev is None:
        raise ValueError("the recipe has no eval section")
    r = config.rollout
    reward = ev.reward or r.reward
    reward_options = ev.reward_options if (ev.reward is not None or ev.reward_options) else r.reward_options
    eval_set = build_eval_set(
        data=ev.data,
        tokenizer=tokenizer,
        reward=reward,
        reward_options=reward_options,
        max_prompts=ev.max_prompts,
        n_samples_per_prompt=ev.n_samples_per_prompt,
        max_new_tokens=ev.max_new_tokens or r.max_new_tokens,
        temperature=ev.temperature,
        generate_fn=r.generate_fn,
        rollout_options=r.options,
    )
    eval_set.services = dict(services or {})
    return eval_set
