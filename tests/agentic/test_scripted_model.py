"""The scripted tool model: its token script matches the session machinery, and it plays it.

The fast test needs only the tokenizer; the slow ones train the model (``tool_model``) and serve
it with a real embedded engine (``tool_engine_url``).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from agentic.scripted_model import (
    CALCULATOR_SPEC,
    PAIRS,
    TARGET_PROBABILITY,
    episode_messages,
    load_training_report,
    script_episode,
    script_episodes,
    script_probabilities,
)

TOOLS = [CALCULATOR_SPEC]


def test_script_is_what_the_session_server_builds(qwen3_family):
    family, tokenizer = qwen3_family
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for a, b in PAIRS:
        episode = script_episode(family, tokenizer, a, b)
        user, call, tool, answer = episode_messages(a, b)
        # Append-only: turn 2's prompt (first render + reply + suffix) is the whole render.
        assert episode.prompt2 == family.render_ids(tokenizer, [user, call, tool], TOOLS)
        assert episode.reply1[-1] == episode.reply2[-1] == end
        parsed = family.parse_reply(tokenizer, list(episode.reply1), tools=TOOLS)
        [got] = parsed.tool_calls
        assert got["function"]["name"] == "calculator"
        assert json.loads(got["function"]["arguments"]) == {"expression": f"{a}+{b}"}
        assert parsed.content == "" and call["tool_calls"][0]["id"] == tool["tool_call_id"]
        assert family.parse_reply(tokenizer, list(episode.reply2), tools=TOOLS).content == answer["content"]


def test_episode_rejects_bad_operands():
    for a, b in [(-1, 2), (1.5, 2), ("1", 2), (True, 2)]:
        with pytest.raises(ValueError, match="non-negative ints"):
            episode_messages(a, b)


@pytest.mark.slow
def test_saved_model_follows_the_script_with_a_margin(tool_model):
    from transformers import AutoModelForCausalLM

    family, tokenizer, model_dir = tool_model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.config.max_position_embeddings == 4096
    probabilities = script_probabilities(model, script_episodes(family, tokenizer))  # raises off-script
    lowest = min(min(p) for p in probabilities)
    assert lowest >= TARGET_PROBABILITY
    assert lowest == pytest.approx(load_training_report(model_dir).min_probability, abs=1e-6)


@pytest.mark.slow
def test_engine_plays_the_episode_token_exactly(tool_model, tool_engine_url):
    from miles.engines.client import SGLangClient
    from miles.types import SamplingParams

    family, tokenizer, _ = tool_model
    client = SGLangClient(tool_engine_url)
    greedy = SamplingParams(
        max_new_tokens=64, temperature=0.0, stop_token_ids=family.stop_token_ids(tokenizer)
    )

    async def play(a: int, b: int) -> None:
        episode = script_episode(family, tokenizer, a, b)
        first = await client.generate(list(episode.prompt1), greedy)
        assert first.finish_reason == "stop"
        assert first.output_ids == list(episode.reply1)
        reply = family.parse_reply(tokenizer, first.output_ids, tools=TOOLS)
        [call] = reply.tool_calls
        assert json.loads(call["function"]["arguments"]) == {"expression": f"{a}+{b}"}
        # Turn 2 as the server builds it: the engine's own ids, then the tool result's suffix.
        tool = episode_messages(a, b)[2]
        suffix = family.suffix_ids(
            tokenizer, [tool], TOOLS, previous=reply.to_message(), stop_id=first.output_ids[-1]
        )
        second = await client.generate(list(episode.prompt1) + first.output_ids + suffix, greedy)
        assert second.finish_reason == "stop"
        assert second.output_ids == list(episode.reply2)
        assert family.parse_reply(tokenizer, second.output_ids, tools=TOOLS).content == str(a + b)

    async def both() -> None:
        # Concurrently, so the engine batches the two episodes (left-padded) as it would in a rollout.
        try:
            await asyncio.gather(play(*PAIRS[0]), play(*PAIRS[3]))
        finally:
            await client.aclose()

    asyncio.run(both())
