"""ReasoningGymReward scores with the task's own checker, using the entry the data source kept."""

from __future__ import annotations

import pytest

from miles.builtins.data.reasoning_gym import ReasoningGymDataSource
from miles.builtins.rewards.reasoning_gym import ReasoningGymReward
from miles.errors import DataError
from miles.types import Prompt, Sample

pytest.importorskip("reasoning_gym")


@pytest.fixture(scope="module")
def prompts() -> list[Prompt]:
    source = ReasoningGymDataSource("chain_sum", size=6, seed=0, shuffle=False)
    return source.next_prompts(6)


def test_correct_wrong_and_tagged_answers(prompts: list[Prompt]) -> None:
    reward = ReasoningGymReward()
    for p in prompts:
        answer = p.label
        assert reward(Sample(prompt=p, response_text=f"Let me add.\n<answer>{answer}</answer>")) == 1.0
        assert reward(Sample(prompt=p, response_text=f" {answer} ")) == 1.0
        assert reward(Sample(prompt=p, response_text=f"<answer>{int(answer) + 1}</answer>")) == 0.0
        assert reward(Sample(prompt=p, response_text="no idea")) == 0.0
        # A tagged answer inside the reasoning is not the answer; the one after it is.
        thought = f"<think><answer>{int(answer) + 1}</answer></think><answer>{answer}</answer>"
        assert reward(Sample(prompt=p, response_text=thought)) == 1.0
        assert reward(Sample(prompt=p, response_text=f"<think><answer>{answer}</answer>")) == 0.0
    # chain_sum gives partial credit when the answer is buried in text.
    p = prompts[0]
    partial = reward(Sample(prompt=p, response_text=f"The sum is {p.label}."))
    assert 0.0 < partial < 1.0


def test_answer_tag_can_be_switched_off(prompts: list[Prompt]) -> None:
    p = prompts[0]
    tagged = f"<answer>{p.label}</answer>"
    assert ReasoningGymReward(answer_tag=None)(Sample(prompt=p, response_text=tagged)) < 1.0


def test_other_tasks_use_their_own_checker() -> None:
    (p,) = ReasoningGymDataSource("basic_arithmetic", size=1, seed=0).next_prompts(1)
    assert ReasoningGymReward()(Sample(prompt=p, response_text=f"<answer>{p.label}</answer>")) == 1.0


def test_prompts_from_elsewhere_are_refused() -> None:
    with pytest.raises(DataError, match=r"prompt 4 has no metadata\['reasoning_gym'\]"):
        ReasoningGymReward()(Sample(prompt=Prompt(index=4, prompt="1+1=", label="2"), response_text="2"))
