"""The built-in multi-turn tool-calling generate function against a real engine serving the trained
calculator model: the trajectory holds exactly the engine's tokens and the tool result's tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentic.scripted_model import PAIRS, script_episode
from miles.builtins.rewards.exact_match import exact_match
from miles.builtins.rollout.default import GroupRollout
from miles.interfaces import RolloutContext
from miles.types import Group, Prompt, SamplingParams, Status
from miles_envs.context import AgenticContext
from miles_envs.tools.calculator import Calculator

pytestmark = pytest.mark.slow


class BrokenCalculator(Calculator):
    """Offers the calculator, but its backend is down: every call raises (not a ToolError)."""

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        raise ConnectionError("calculator backend unreachable")


def _rollout(url: str, family: Any, tokenizer: Any, prompts: list[Prompt], **agentic: Any) -> list[Group]:
    from miles.engines.client import SGLangClient

    async def go() -> list[Group]:
        engine = SGLangClient(url)
        ctx = RolloutContext(
            engines=[engine],
            tokenizer=tokenizer,
            sampling=SamplingParams(max_new_tokens=40, temperature=0.0),
            n_samples_per_prompt=1,
            reward=exact_match,
            services={"agentic": AgenticContext(family=family, **{"toolset": Calculator(), **agentic})},
        )
        try:
            return await GroupRollout(generate_fn="multi_turn")(ctx, prompts)
        finally:
            await engine.aclose()

    return asyncio.run(go())


def _prompt(index: int, a: int, b: int) -> Prompt:
    return Prompt(index=index, prompt=f"What is {a}+{b}?", label=str(a + b))


def test_a_tool_calling_episode_becomes_one_token_exact_sample(tool_model, tool_engine_url) -> None:
    family, tokenizer, _ = tool_model
    pairs = PAIRS[:3]
    groups = _rollout(
        tool_engine_url, family, tokenizer, [_prompt(i, a, b) for i, (a, b) in enumerate(pairs)]
    )
    for group, (a, b) in zip(groups, pairs, strict=True):
        (sample,) = group.samples
        script = script_episode(family, tokenizer, a, b)
        assert sample.prompt_ids == list(script.prompt1)
        assert sample.response_ids == [*script.reply1, *script.suffix, *script.reply2]
        # Only the model's own tokens are trained on; the tool result and the template glue are not.
        assert sample.loss_mask == [1] * len(script.reply1) + [0] * len(script.suffix) + [1] * len(
            script.reply2
        )
        generated = [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if m]
        assert all(-0.01 < lp <= 0.0 for lp in generated)  # the engine's log-probs of a sharp model
        assert [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if not m] == [
            0.0
        ] * len(script.suffix)
        assert sample.weight_versions == [0] * len(sample.response_ids)
        assert sample.status is Status.COMPLETED
        assert sample.response_text == str(a + b)
        assert sample.reward == 1.0
        assert sample.metadata["tool_calls"] == 1 and sample.metadata["ended_by"] == "stop"
        assert sample.metadata["turns"] == 2


def test_running_out_of_turns_or_tokens_is_truncated(tool_model, tool_engine_url) -> None:
    family, tokenizer, _ = tool_model
    a, b = PAIRS[0]
    script = script_episode(family, tokenizer, a, b)
    (one_turn,) = _rollout(tool_engine_url, family, tokenizer, [_prompt(0, a, b)], max_turns=1)
    sample = one_turn.samples[0]
    assert sample.response_ids == list(script.reply1)  # the tool call, then the episode ran out of turns
    assert sample.status is Status.TRUNCATED and sample.metadata["ended_by"] == "max_turns"

    # Room for the first reply only: the second turn has no tokens left.
    limit = len(script.prompt1) + len(script.reply1) + len(script.suffix)
    (short,) = _rollout(tool_engine_url, family, tokenizer, [_prompt(0, a, b)], max_seq_len=limit)
    sample = short.samples[0]
    assert sample.response_ids == list(script.reply1)
    assert sample.status is Status.TRUNCATED and sample.metadata["ended_by"] == "max_seq_len"

    # A limit inside the first reply: the engine stops at it, the session records a length finish.
    cut = len(script.prompt1) + 5
    (cut_short,) = _rollout(tool_engine_url, family, tokenizer, [_prompt(0, a, b)], max_seq_len=cut)
    sample = cut_short.samples[0]
    assert sample.response_ids == list(script.reply1[:5])
    assert sample.status is Status.TRUNCATED and sample.finish_reason == "length"


def test_a_broken_tool_set_fails_the_episode_not_the_rollout(tool_model, tool_engine_url) -> None:
    family, tokenizer, _ = tool_model
    a, b = PAIRS[0]
    prompts = [_prompt(0, a, b)]
    (group,) = _rollout(tool_engine_url, family, tokenizer, prompts, toolset=BrokenCalculator())
    (sample,) = group.samples
    assert sample.status is Status.FAILED and sample.reward is None
    assert "ConnectionError: calculator backend unreachable" in sample.metadata["failure"]
    assert sample.response_ids == list(script_episode(family, tokenizer, a, b).reply1)  # what ran is kept
