"""The rollout layer around generate functions that yield several samples per attempt (a branching
session's leaves), and the agent function's return values."""

from __future__ import annotations

import asyncio

import pytest

from miles.builtins.rollout.default import GroupRollout
from miles.errors import ComponentError
from miles.interfaces import RolloutContext
from miles.types import Prompt, Sample, SamplingParams, Status
from miles_envs.interfaces import AgentResult
from miles_envs.rollout.agentic import as_agent_result


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _filled(slot: Sample, text: str) -> Sample:
    sample = Sample(prompt=slot.prompt, group_index=slot.group_index, prompt_ids=list(slot.prompt_ids))
    sample.response_ids = [ord(c) for c in text]
    sample.response_text = text
    sample.rollout_logprobs = [-0.1] * len(text)
    sample.loss_mask = [1] * len(text)
    sample.weight_versions = [0] * len(text)
    sample.status = Status.COMPLETED
    return sample


async def two_leaves(ctx: RolloutContext, slot: Sample) -> list[Sample]:
    return [_filled(slot, f"a{slot.group_index}"), _filled(slot, f"b{slot.group_index}")]


async def returns_nothing_useful(ctx: RolloutContext, slot: Sample) -> list:
    return []


def _ctx(reward, done: list, generated: list) -> RolloutContext:
    return RolloutContext(
        engines=[],
        tokenizer=CharTokenizer(),
        sampling=SamplingParams(),
        n_samples_per_prompt=2,
        reward=reward,
        on_sample_done=done.append,
        on_generation_done=generated.append,
    )


def test_every_leaf_takes_the_attempts_place_and_is_rewarded() -> None:
    done: list[Sample] = []
    generated: list[Sample] = []
    rollout = GroupRollout(generate_fn=f"{__name__}:two_leaves")
    ctx = _ctx(lambda s: float(s.response_text.startswith("a")), done, generated)
    (group,) = asyncio.run(rollout(ctx, [Prompt(index=0, prompt="q")]))
    assert [s.response_text for s in group.samples] == ["a0", "b0", "a1", "b1"]
    assert [s.group_index for s in group.samples] == [0, 1, 2, 3]
    assert [s.reward for s in group.samples] == [1.0, 0.0, 1.0, 0.0]
    assert len(done) == 4  # every produced sample is reported done
    assert len(generated) == 2  # one generation per attempt (frees one slot of the async worker each)


def test_a_generate_function_returning_no_sample_is_an_error() -> None:
    rollout = GroupRollout(generate_fn=f"{__name__}:returns_nothing_useful")
    with pytest.raises(TypeError, match="non-empty list of Samples"):
        asyncio.run(rollout(_ctx(lambda s: 0.0, [], []), [Prompt(index=0, prompt="q")]))


def test_agent_return_values() -> None:
    assert as_agent_result(None) == AgentResult()
    assert as_agent_result({"reward": 1, "metadata": {"k": 1}}) == AgentResult(reward=1, metadata={"k": 1})
    result = AgentResult(failure="tool crashed")
    assert as_agent_result(result) is result
    with pytest.raises(ComponentError, match="unknown keys"):
        as_agent_result({"score": 1})
    with pytest.raises(ComponentError, match="must return"):
        as_agent_result(3.0)
