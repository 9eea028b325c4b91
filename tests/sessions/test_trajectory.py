"""Trajectory assembly: one contiguous sequence, masks, logprobs, versions and experts aligned."""

from __future__ import annotations

import pytest

from miles.types import Prompt, Status
from miles_envs.sessions import BranchingSession, LinearSession, assemble, session_samples
from miles_envs.sessions.trajectory import NO_EXPERT

from .helpers import Engine, assistant, expert_row, play, user, weather_episode

PROMPT = Prompt(index=7, prompt="weather")


def test_linear_session_is_one_contiguous_sample() -> None:
    engine, session = Engine(), LinearSession()
    c1, c2, c3 = play(engine, session, versions=None)
    (sample,) = session_samples(session, PROMPT, group_index=2)
    sample.check_aligned()
    assert sample.prompt is PROMPT and sample.group_index == 2
    assert sample.prompt_ids == list(c1.prompt_suffix_ids)
    assert sample.prompt_ids + sample.response_ids == c3.token_ids()
    expected_mask = (
        [1] * len(c1.output_ids)
        + [0] * len(c2.prompt_suffix_ids)
        + [1] * len(c2.output_ids)
        + [0] * len(c3.prompt_suffix_ids)
        + [1] * len(c3.output_ids)
    )
    assert sample.loss_mask == expected_mask
    generated = [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if m]
    assert generated == [*c1.output_logprobs, *c2.output_logprobs, *c3.output_logprobs]
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if not m)
    assert sample.status is Status.COMPLETED and sample.finish_reason == "stop"
    assert sample.response_text == "It is 21 C at 14:00 in Paris."
    assert sample.routed_experts is None
    assert sample.metadata["session_id"] == session.id and sample.metadata["checkpoint_ids"] == [0, 1, 2]


def test_weight_versions_follow_the_tokens_across_an_update() -> None:
    engine, session = Engine(), LinearSession()
    (m1, r1), (m2, r2), _ = weather_episode()
    c1 = engine.run(session, m1, r1, versions=[3, 3, 3])
    c2 = engine.run(session, m2, r2, n_out=4, versions=[4, 4, 5, 5])  # an update landed mid-generation
    (sample,) = session_samples(session, PROMPT)
    assert sample.weight_versions == [3, 3, 3] + [4] * len(c2.prompt_suffix_ids) + [4, 4, 5, 5]
    assert sample.oldest_weight_version == 3
    assert c1.prefill_version == 3


def test_routed_experts_are_aligned_token_by_token() -> None:
    engine, session = Engine(), LinearSession()
    turns = weather_episode()
    c1 = engine.run(session, *turns[0], experts=True)
    c2 = engine.run(session, *turns[1], experts=True, suffix_experts=True)
    c3 = engine.run(session, *turns[2], experts=True)  # no rows recorded for this suffix
    (sample,) = session_samples(session, PROMPT)
    rows = sample.routed_experts
    assert rows is not None and len(rows) == len(sample.response_ids)
    pad = [[NO_EXPERT, NO_EXPERT], [NO_EXPERT, NO_EXPERT]]
    expected = (
        [expert_row(t) for t in c1.output_ids]
        + [expert_row(t) for t in c2.prompt_suffix_ids]
        + [expert_row(t) for t in c2.output_ids]
        + [pad] * len(c3.prompt_suffix_ids)
        + [expert_row(t) for t in c3.output_ids]
    )
    assert rows == expected


def test_experts_are_recorded_for_every_turn_or_none() -> None:
    engine, session = Engine(), LinearSession()
    turns = weather_episode()
    engine.run(session, *turns[0], experts=True)
    plan = session.plan(turns[1][0])
    with pytest.raises(ValueError, match="routed_experts missing for this turn but given for earlier turns"):
        engine.commit(session, plan, turns[1][1])
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        session.commit(
            plan,
            prompt_suffix_ids=[1],
            output_ids=[2],
            output_logprobs=[-1.0],
            weight_versions=[0],
            finish_reason="stop",
            assistant_message=turns[1][1],
            routed_experts=[expert_row(2, layers=3)],
        )


@pytest.mark.parametrize(
    ("finish", "failure", "status"),
    [
        ("stop", None, Status.COMPLETED),
        ("tool_calls", None, Status.COMPLETED),
        ("length", None, Status.TRUNCATED),
        ("abort", None, Status.ABORTED),
        ("stop", "sandbox crashed", Status.FAILED),
        ("length", "reward server down", Status.FAILED),
    ],
)
def test_status_comes_from_the_last_turn(finish: str, failure: str | None, status: Status) -> None:
    engine, session = Engine(), LinearSession()
    (m1, r1), (m2, r2), _ = weather_episode()
    engine.run(session, m1, r1)
    engine.run(session, m2, r2, finish=finish)
    (sample,) = session_samples(session, PROMPT, failure=failure)
    assert sample.status is status and sample.finish_reason == finish
    assert sample.metadata.get("failure") == failure


def test_an_aborted_generation_without_tokens_still_assembles() -> None:
    engine, session = Engine(), LinearSession()
    (m1, r1), (m2, _), _ = weather_episode()
    engine.run(session, m1, r1)
    plan = session.plan(m2)
    session.commit(
        plan,
        prompt_suffix_ids=[9, 9],
        output_ids=[],
        output_logprobs=[],
        weight_versions=[],
        weight_version=6,
        finish_reason="abort",
        assistant_message=assistant(""),
    )
    (sample,) = session_samples(session, PROMPT)
    assert sample.status is Status.ABORTED and sample.response_ids[-2:] == [9, 9]
    assert sample.weight_versions[-2:] == [6, 6] and sample.loss_mask[-2:] == [0, 0]


def test_a_retried_turn_is_not_in_the_linear_sample() -> None:
    engine, session = Engine(), LinearSession()
    _c1, c2 = play(engine, session, turns=2)
    c2b = engine.run(session, weather_episode()[1][0], assistant("retry"))
    (sample,) = session_samples(session, PROMPT)
    assert sample.prompt_ids + sample.response_ids == c2b.token_ids()
    assert not set(c2.output_ids) & set(sample.response_ids)


def test_branching_yields_one_sample_per_leaf_and_trains_shared_turns_once() -> None:
    engine, session = Engine(), BranchingSession()
    c1, _c2, c3 = play(engine, session)
    fork = [*weather_episode()[1][0][:-1], user("And Lyon?")]
    b2 = engine.run(session, fork, assistant("18 C"), finish="length")
    first, second = session_samples(session, PROMPT)
    assert first.prompt_ids + first.response_ids == c3.token_ids()
    assert second.prompt_ids + second.response_ids == b2.token_ids()
    assert first.status is Status.COMPLETED and second.status is Status.TRUNCATED
    n1 = len(c1.output_ids)
    assert first.loss_mask[:n1] == [1] * n1  # the shared first turn is trained in the older leaf...
    assert second.loss_mask[:n1] == [0] * n1  # ...and masked in the newer one
    assert second.loss_mask[-len(b2.output_ids) :] == [1] * len(b2.output_ids)
    assert [s.metadata["leaf"] for s in (first, second)] == [c3.id, b2.id]
    shared = session_samples(session, PROMPT, exclusive=False)
    assert shared[1].loss_mask[:n1] == [1] * n1
    for s in (first, second, *shared):
        s.check_aligned()


def test_empty_session_has_no_samples_and_bad_paths_are_refused() -> None:
    assert session_samples(LinearSession(), PROMPT) == []
    engine, session = Engine(), BranchingSession()
    c1, c2, c3 = play(engine, session)
    with pytest.raises(ValueError, match="empty checkpoint path"):
        assemble([], PROMPT)
    with pytest.raises(ValueError, match="must start at a root"):
        assemble([c2, c3], PROMPT)
    with pytest.raises(ValueError, match="does not extend"):
        assemble([c1, c3], PROMPT)
