"""GroupRollout with group rewards and reward post-processors, on a generate function that needs no engine.

``fake_generate`` plays back what each prompt's ``metadata["plan"]`` says its samples are:
one ``[response_text, n_tokens, status]`` per sample, by ``group_index``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles.builtins.reward_postprocess import OverlongPenalty
from miles.builtins.rollout.default import GroupRollout
from miles.interfaces import RolloutContext
from miles.types import Group, Prompt, Sample, SamplingParams, Status

FINISH = {Status.COMPLETED: "stop", Status.TRUNCATED: "length", Status.ABORTED: "abort"}


async def fake_generate(ctx: RolloutContext, sample: Sample) -> Sample:
    """A generate function (selected by import path) that fills every per-token field without an engine."""
    text, length, status = sample.prompt.metadata["plan"][sample.group_index]
    sample.response_ids = list(range(100, 100 + length))
    sample.response_text = text
    sample.rollout_logprobs = [-0.5] * length
    sample.loss_mask = [1] * length
    sample.weight_versions = [ctx.step] * length
    sample.status = Status(status)
    sample.finish_reason = FINISH[sample.status]
    return sample


class CharTokenizer:
    """Stands in for a transformers tokenizer: rendering a plain-string prompt only calls ``encode``."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


class ShortestWins:
    """A group reward: 1.0 for the group's shortest responses, 0.0 for the others. Records its calls."""

    group_reward = True

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, int]]] = []

    def __call__(self, samples: list[Sample]) -> list[float]:
        self.calls.append([(s.prompt.index, s.group_index) for s in samples])
        shortest = min(len(s.response_ids) for s in samples)
        return [1.0 if len(s.response_ids) == shortest else 0.0 for s in samples]


class AsyncShortestWins(ShortestWins):
    """The same, as a coroutine (a judge behind an HTTP call would be one)."""

    async def __call__(self, samples: list[Sample]) -> list[float]:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().__call__(samples)


def prompt(index: int, *plan: tuple[str, int, str]) -> Prompt:
    return Prompt(index=index, prompt=f"q{index}", label="4", metadata={"plan": [list(p) for p in plan]})


def rollout(
    reward: Any, prompts: list[Prompt], post: list[Any] | None = None
) -> tuple[list[Group], list[Sample]]:
    done: list[Sample] = []
    ctx = RolloutContext(
        engines=[],
        tokenizer=CharTokenizer(),
        sampling=SamplingParams(),
        n_samples_per_prompt=len(prompts[0].metadata["plan"]),
        reward=reward,
        reward_postprocess=post or [],
        on_sample_done=done.append,
    )
    rollout_fn = GroupRollout(generate_fn=f"{__name__}:fake_generate")
    return asyncio.run(rollout_fn(ctx, prompts)), done


def rewards(group: Group) -> list[float | None]:
    return [s.reward for s in group.samples]


@pytest.mark.parametrize("reward_cls", [ShortestWins, AsyncShortestWins])
def test_group_reward_sees_each_whole_group_once(reward_cls: type[ShortestWins]) -> None:
    reward = reward_cls()
    prompts = [
        prompt(0, ("4", 1, "completed"), ("2+2 is 4", 8, "completed"), ("it is", 5, "truncated")),
        prompt(1, ("four", 4, "completed"), ("4", 1, "completed"), ("4", 1, "completed")),
    ]
    groups, done = rollout(reward, prompts)
    assert sorted(reward.calls) == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]
    assert rewards(groups[0]) == [1.0, 0.0, 0.0]  # lengths 1, 8, 5: the first is shortest
    assert rewards(groups[1]) == [0.0, 1.0, 1.0]  # lengths 4, 1, 1
    assert [s.status for s in groups[0].samples] == [Status.COMPLETED, Status.COMPLETED, Status.TRUNCATED]
    assert groups[0].samples[0].prompt_ids == [ord("q"), ord("0")]  # rendered by the tokenizer
    assert len(done) == 6  # every sample reported once


def test_aborted_samples_are_not_shown_to_the_group_reward() -> None:
    reward = ShortestWins()
    groups, _ = rollout(
        reward, [prompt(0, ("4", 1, "aborted"), ("2+2 is 4", 8, "completed"), ("it is", 5, "completed"))]
    )
    assert reward.calls == [[(0, 1), (0, 2)]]
    # Among the two that finished, the 5-token one is shortest; the aborted one keeps no reward.
    assert rewards(groups[0]) == [None, 0.0, 1.0]
    assert groups[0].samples[0].status is Status.ABORTED


def test_a_group_with_no_finished_sample_is_not_scored() -> None:
    reward = ShortestWins()
    groups, done = rollout(reward, [prompt(0, ("", 0, "aborted"), ("", 0, "aborted"))])
    assert reward.calls == []
    assert rewards(groups[0]) == [None, None]
    assert len(done) == 2


class OneRewardOnly(ShortestWins):
    def __call__(self, samples: list[Sample]) -> list[float]:
        super().__call__(samples)
        return [1.0]


class Raises(ShortestWins):
    def __call__(self, samples: list[Sample]) -> list[float]:
        raise RuntimeError("judge unavailable")


@pytest.mark.parametrize(
    ("reward", "error"),
    [
        (OneRewardOnly(), "ValueError: group reward returned 1 rewards for 3 samples"),
        (Raises(), "RuntimeError: judge unavailable"),
    ],
)
def test_a_failing_group_reward_fails_its_samples(reward: ShortestWins, error: str) -> None:
    plan = [("4", 1, "completed"), ("four", 4, "completed"), ("2+2=4", 5, "truncated")]
    # The penalty would change every reward here (lengths 1..5 with max_len 2, cache_len 1),
    # so rewards left at 0.0 also show that post-processors skip FAILED samples.
    groups, _ = rollout(reward, [prompt(0, *plan)], post=[OverlongPenalty(max_len=2, cache_len=1)])
    for s in groups[0].samples:
        assert s.status is Status.FAILED
        assert s.reward == 0.0
        assert s.metadata["reward_error"] == error


def add_one(sample: Sample, reward: float) -> float:
    return reward + 1.0


def double(sample: Sample, reward: float) -> float:
    return reward * 2.0


@pytest.mark.parametrize(
    ("post", "expected"),
    [
        # ShortestWins gives [1, 0, 0]. add_one then double: (r + 1) * 2 -> [4, 2, 2].
        ([add_one, double], [4.0, 2.0, 2.0]),
        # double then add_one: r * 2 + 1 -> [3, 1, 1].
        ([double, add_one], [3.0, 1.0, 1.0]),
        # OverlongPenalty(max_len=10, cache_len=4): start = 6. Lengths 5, 8, 12:
        #   5 <= 6          -> +0
        #   6 < 8 <= 10     -> (6 - 8) / 4 = -0.5
        #   12 > 10         -> -1
        # so [1 + 0, 0 - 0.5, 0 - 1] = [1, -0.5, -1]; then add_one -> [2, 0.5, 0].
        ([OverlongPenalty(max_len=10, cache_len=4), add_one], [2.0, 0.5, 0.0]),
    ],
)
def test_post_processors_apply_in_order_after_the_group_reward(
    post: list[Any], expected: list[float]
) -> None:
    plan = [("4", 5, "completed"), ("2+2 is 4", 8, "completed"), ("it is ...", 12, "truncated")]
    groups, _ = rollout(ShortestWins(), [prompt(0, *plan)], post=post)
    assert rewards(groups[0]) == pytest.approx(expected)


def test_post_processors_apply_to_a_per_sample_reward() -> None:
    def reward(sample: Sample) -> float:  # a plain per-sample reward: no group_reward attribute
        return 1.0 if sample.response_text == "4" else 0.0

    plan = [("4", 9, "completed"), ("5", 3, "completed"), ("4", 1, "aborted")]
    groups, _ = rollout(
        reward, [prompt(0, *plan)], post=[OverlongPenalty(max_len=10, cache_len=4, factor=0.5)]
    )
    # start = 6; length 9: 0.5 * (6 - 9) / 4 = -0.375 -> 1 - 0.375 = 0.625; length 3: no penalty.
    assert rewards(groups[0]) == pytest.approx([0.625, 0.0, None])
