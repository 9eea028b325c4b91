"""Branching sessions: attach at the deepest matching checkpoint, branch the rest, delete nothing."""

from __future__ import annotations

import pytest

from miles_envs.sessions import (
    AbortedBranch,
    BranchingSession,
    EmptyTurn,
    SessionFull,
    TruncatedBranch,
    json_args,
)

from .helpers import SYSTEM, USER, Engine, assistant, play, tool_call, user, weather_episode


def test_a_growing_conversation_is_one_leaf() -> None:
    engine, session = Engine(), BranchingSession()
    c1, c2, c3 = play(engine, session)
    assert c3.parent is c2 and c2.parent is c1
    assert session.leaves() == [c3]
    assert session.trajectories() == [[c1, c2, c3]]


def test_a_branch_from_the_middle_keeps_both_lineages() -> None:
    engine, session = Engine(), BranchingSession()
    c1, c2, c3 = play(engine, session)
    m2 = weather_episode()[1][0]
    # The harness compacts: after turn 1 it asks something else instead of the tool result.
    fork = [*m2[:-1], user("Never mind, what about Lyon?")]
    plan = session.plan(fork)
    assert plan.parent is c1 and [m.role for m in plan.new_messages] == ["user"]
    assert plan.prefix_ids == c1.token_ids()
    b2 = engine.commit(session, plan, assistant("Lyon: 18 C."))
    assert session.leaves() == [c3, b2]
    paths = session.trajectories()
    assert paths == [[c1, c2, c3], [c1, b2]]
    assert b2.token_ids()[: c1.num_tokens] == c1.token_ids()
    assert len(session.checkpoints()) == 4  # nothing deleted
    # Extending the new branch attaches to it, not to the old lineage.
    assert session.plan([*fork, assistant("Lyon: 18 C."), user("thanks")]).parent is b2


def test_an_unmatched_request_opens_a_new_root() -> None:
    engine, session = Engine(), BranchingSession()
    play(engine, session, turns=2)
    plan = session.plan([SYSTEM, user("Summary of the task so far: ...")])
    assert plan.parent is None and plan.prefix_ids == []
    root2 = engine.commit(session, plan, assistant("ok"))
    assert session.stats()["roots"] == 2 and root2 in session.leaves()


def test_a_partly_matched_turn_does_not_count_and_ties_go_to_the_newest() -> None:
    engine, session = Engine(), BranchingSession()
    (m1, r1), (m2, r2), _ = weather_episode()
    c1 = engine.run(session, m1, r1)
    a = engine.run(session, m2, r2)
    b = engine.run(session, m2, assistant("", [tool_call("call_9", "get_time", "{}")]))  # a sibling of a
    # Matches c1 and the new tool message of a and b, but not their replies: attach to c1.
    assert session.plan([*m2, assistant("different reply"), user("?")]).parent is c1
    # Matches both a's and b's whole path? Only one reply can match; replay b's reply.
    assert session.plan([*m2, b.assistant.to_openai(), user("?")]).parent is b
    assert session.plan([*m2, a.assistant.to_openai(), user("?")]).parent is a
    # Two identical siblings (the same reply sampled twice): the newest wins.
    c = engine.run(session, m2, r2)
    assert session.plan([*m2, r2, user("?")]).parent is c


@pytest.mark.parametrize(("finish", "error"), [("length", TruncatedBranch), ("abort", AbortedBranch)])
def test_a_cut_off_branch_cannot_be_extended_but_others_can(finish: str, error: type) -> None:
    engine, session = Engine(), BranchingSession()
    (m1, r1), (m2, r2), _ = weather_episode()
    c1 = engine.run(session, m1, r1)
    cut = engine.run(session, m2, assistant("It is"), finish=finish)
    with pytest.raises(error, match="retry that turn") as info:
        session.plan([*m2, assistant("It is"), user("continue")])
    assert info.value.index == cut.num_messages
    retry = session.plan(m2)  # the same turn again: a sibling of the cut-off one
    assert retry.parent is c1
    ok = engine.commit(session, retry, r2)
    assert session.plan([*m2, r2, user("more")]).parent is ok
    assert cut in session.checkpoints()


def test_retried_leaves_are_dropped_by_default_and_forks_are_kept() -> None:
    engine, session = Engine(), BranchingSession()
    (m1, r1), (m2, r2), (m3, r3) = weather_episode()
    c1 = engine.run(session, m1, r1)
    first_try = engine.run(session, m2, assistant("oops"))
    second_try = engine.run(session, m2, r2)  # same request, later: a retry of turn 2
    c3 = engine.run(session, m3, r3)
    fork = engine.run(session, [*m2[:-1], user("And Lyon?")], assistant("18 C"))  # a different request
    assert set(session.leaves()) == {first_try, c3, fork}
    assert session.trajectories() == [[c1, second_try, c3], [c1, fork]]
    assert session.trajectories("all") == [[c1, first_try], [c1, second_try, c3], [c1, fork]]


def test_reserialised_arguments_fork_under_strict_and_extend_under_json_args() -> None:
    turns = weather_episode()
    replay = [*turns[1][0]]
    replay[2] = {
        **turns[0][1],
        "tool_calls": [tool_call("call_1", "get_weather", '{"unit":"C","city":"Paris"}')],
    }
    for matcher, expect_parent_depth in ((None, None), (json_args, 1)):
        session = BranchingSession() if matcher is None else BranchingSession(matcher=matcher)
        engine = Engine()
        engine.run(session, *turns[0])
        plan = session.plan(replay)
        assert (plan.parent.depth if plan.parent else None) == expect_parent_depth


def test_a_request_equal_to_a_recorded_path_adds_nothing() -> None:
    engine, session = Engine(), BranchingSession()
    (c1,) = play(engine, session, turns=1)
    with pytest.raises(EmptyTurn):
        session.plan([m.to_openai() for m in c1.path_messages()])
    assert session.plan([SYSTEM, USER]).parent is None  # the first turn again: a new root (a retry)


def test_concurrent_plans_cannot_overrun_the_checkpoint_limit() -> None:
    engine, session = Engine(), BranchingSession(max_checkpoints=2)
    play(engine, session, turns=1)
    m2, r2 = weather_episode()[1]
    a, b = session.plan(m2), session.plan(m2)  # both admitted while one slot is left
    engine.commit(session, a, r2)
    with pytest.raises(SessionFull):
        engine.commit(session, b, r2)
    assert len(session.checkpoints()) == 2 and session.stats()["in_flight"] == 0
