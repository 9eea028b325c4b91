"""Linear sessions: extend the tail, retry the latest turn, refuse earlier divergence."""

from __future__ import annotations

import pytest

from miles_envs.sessions import (
    AbortedBranch,
    EmptyTurn,
    HistoryDiverged,
    LinearSession,
    Message,
    SessionClosed,
    SessionFull,
    StalePlan,
    TruncatedBranch,
    json_args,
)

from .helpers import SYSTEM, USER, Engine, assistant, play, tool, tool_call, user, weather_episode


def test_each_turn_extends_the_tail_and_tokens_only_grow() -> None:
    engine, session = Engine(), LinearSession()
    turns = weather_episode()
    previous: list[int] = []
    for i, (messages, reply) in enumerate(turns):
        plan = session.plan(messages)
        assert plan.prefix_ids == previous
        assert len(plan.history) == (len(turns[i - 1][0]) + 1 if i else 0)
        ckpt = engine.commit(session, plan, reply)
        assert ckpt.token_ids()[: len(previous)] == previous
        assert ckpt.depth == i + 1
        previous = ckpt.token_ids()
    (path,) = session.trajectories()
    assert [c.depth for c in path] == [1, 2, 3]
    assert session.stats() == {
        "mode": "linear",
        "turns": 3,
        "checkpoints": 3,
        "retried_turns": 0,
        "tokens": len(previous),
    }


def test_plan_reports_only_the_new_messages_and_the_recorded_history() -> None:
    engine, session = Engine(), LinearSession(matcher=json_args)
    (m1, r1), (m2, _), _ = weather_episode()
    engine.run(session, m1, r1)
    # The agent replays the tool call re-serialised: json_args accepts it, the recorded one stays.
    replayed = {**r1, "tool_calls": [tool_call("call_1", "get_weather", '{"unit":"C","city":"Paris"}')]}
    plan = session.plan([*m1, replayed, m2[-1]])
    assert plan.parent is not None and plan.parent.depth == 1 and plan.replaces is None
    assert [m.role for m in plan.new_messages] == ["tool"]
    assert plan.history[-1] == Message.from_openai(r1)  # recorded, not replayed
    assert plan.history[-1].tool_calls[0].arguments == '{"city": "Paris", "unit": "C"}'


@pytest.mark.parametrize("edit", ["resend", "edit_tool_result"])
def test_retrying_the_latest_turn_replaces_it(edit: str) -> None:
    engine, session = Engine(), LinearSession()
    c1, c2 = play(engine, session, turns=2)
    m2 = weather_episode()[1][0]
    request = m2 if edit == "resend" else [*m2[:-1], tool("call_1", '{"temp": 22}')]
    plan = session.plan(request)
    assert plan.parent is c1 and plan.replaces is c2
    assert len(session.trajectories()[0]) == 2  # nothing changes before the commit
    c2b = engine.commit(session, plan, assistant("It is warm."))
    (path,) = session.trajectories()
    assert path == [c1, c2b]
    assert c2 in session.checkpoints() and session.stats()["retried_turns"] == 1
    # The retry's reply is the recorded one now: replaying the old reply is another retry of turn 2.
    again = session.plan(weather_episode()[2][0])
    assert again.parent is c1 and again.replaces is c2b
    session.abandon(again)
    assert session.plan([*request, assistant("It is warm."), user("ok")]).parent is c2b


def test_retrying_the_first_turn_starts_over() -> None:
    engine, session = Engine(), LinearSession()
    (c1,) = play(engine, session, turns=1)
    plan = session.plan([SYSTEM, USER])
    assert plan.parent is None and plan.replaces is c1 and plan.prefix_ids == []
    c1b = engine.commit(session, plan, assistant("Sunny."))
    assert session.trajectories() == [[c1b]]


def test_earlier_divergence_is_refused_with_the_index_and_the_field() -> None:
    engine, session = Engine(), LinearSession()
    play(engine, session, turns=3)
    m3 = weather_episode()[2][0]
    bad = [*m3]
    bad[3] = tool("call_1", '{"temp": 30}')  # the first tool result, in turn 2 of 3
    with pytest.raises(HistoryDiverged) as info:
        session.plan([*bad, m3[-1]])
    err = info.value
    assert err.index == 3 and err.code == "history_diverged"
    assert "message 3 (tool)" in str(err) and "differs in content" in str(err)
    assert "turn 2 of 3" in str(err) and "roll back 2 turns" in str(err)
    with pytest.raises(HistoryDiverged, match=r"message 1 \(user\).*differs in content.*turn 1 of 3"):
        session.plan([SYSTEM, user("another question")])
    assert len(session.trajectories()[0]) == 3  # refused requests change nothing
    assert session.plan([*m3, assistant("It is 21 C at 14:00 in Paris.", reasoning="done"), user("thanks")])


def test_a_request_that_stops_inside_earlier_history_is_refused() -> None:
    engine, session = Engine(), LinearSession()
    play(engine, session, turns=3)
    with pytest.raises(HistoryDiverged, match="ends after message 1, inside the recorded history"):
        session.plan([SYSTEM, USER])


def test_reserialised_tool_arguments_diverge_under_strict_but_extend_under_json_args() -> None:
    turns = weather_episode()
    m3 = turns[2][0]
    reserialised = [*m3]
    reserialised[2] = {
        **turns[0][1],
        "tool_calls": [tool_call("call_1", "get_weather", '{"unit": "C", "city": "Paris"}')],
    }
    strict_session, loose_session = LinearSession(), LinearSession(matcher=json_args)
    for session in (strict_session, loose_session):
        play(Engine(), session, turns=2)
    with pytest.raises(HistoryDiverged, match=r"tool_calls\[0\]\.arguments"):
        strict_session.plan(reserialised)
    plan = loose_session.plan(reserialised)
    assert plan.parent is not None and plan.parent.depth == 2 and plan.replaces is None


def test_reasoning_dropped_on_replay_of_the_latest_turn_is_a_retry_under_strict() -> None:
    engine, session = Engine(), LinearSession()
    _, c2 = play(engine, session, turns=2)
    m3 = [*weather_episode()[2][0]]
    m3[4] = {k: v for k, v in m3[4].items() if k != "reasoning_content"}
    plan = session.plan(m3)
    # The documented pitfall: the recorded turn is replaced, the replayed reply becomes history.
    assert plan.replaces is c2 and [m.role for m in plan.new_messages] == ["tool", "assistant", "tool"]


def test_a_request_adding_nothing_is_refused() -> None:
    engine, session = Engine(), LinearSession()
    c1, c2 = play(engine, session, turns=2)
    with pytest.raises(EmptyTurn, match="adds no message"):
        session.plan([m.to_openai() for m in c2.path_messages()])
    with pytest.raises(EmptyTurn):
        session.plan([m.to_openai() for m in c1.path_messages()])


@pytest.mark.parametrize(("finish", "error"), [("length", TruncatedBranch), ("abort", AbortedBranch)])
def test_a_cut_off_turn_cannot_be_extended_but_can_be_retried(finish: str, error: type) -> None:
    engine, session = Engine(), LinearSession()
    (m1, r1), (m2, r2), _ = weather_episode()
    engine.run(session, m1, r1)
    cut = engine.run(session, m2, assistant("It is"), finish=finish)
    with pytest.raises(error) as info:
        session.plan([*m2, assistant("It is"), user("go on")])
    assert info.value.index == len(m2) + 1
    plan = session.plan(m2)
    assert plan.replaces is cut
    engine.commit(session, plan, r2)
    assert session.trajectories()[0][-1].finish_reason == "stop"


def test_plans_are_single_use_and_turn_abandons_on_error() -> None:
    engine, session = Engine(), LinearSession()
    m1, r1 = weather_episode()[0]
    plan = session.plan(m1)
    engine.commit(session, plan, r1)
    with pytest.raises(StalePlan):
        engine.commit(session, plan, r1)
    m2, r2 = weather_episode()[1]
    with pytest.raises(RuntimeError, match="engine down"), session.turn(m2):
        raise RuntimeError("engine down")
    with session.turn(m2) as plan2:  # the failed turn left the session free
        engine.commit(session, plan2, r2)
    session.abandon(plan2)  # abandoning a committed plan is a no-op...
    with pytest.raises(StalePlan):  # ...and committing it again is refused
        engine.commit(session, plan2, r2)
    with pytest.raises(StalePlan, match="another session"):
        engine.commit(LinearSession(), plan2, r2)


def test_bad_results_are_refused_and_leave_the_plan_open() -> None:
    session = LinearSession()
    plan = session.plan([SYSTEM, USER])
    common = dict(prompt_suffix_ids=[1, 2], finish_reason="stop", assistant_message=assistant("x"))
    with pytest.raises(ValueError, match="output_logprobs has 1 entries for 2 output tokens"):
        session.commit(plan, output_ids=[5, 6], output_logprobs=[-0.1], weight_versions=[0, 0], **common)
    with pytest.raises(ValueError, match="weight_versions has 1 entries"):
        session.commit(plan, output_ids=[5, 6], output_logprobs=[-0.1, -0.2], weight_versions=[0], **common)
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        session.commit(
            plan,
            output_ids=[5],
            output_logprobs=[-0.1],
            weight_versions=[0],
            **{**common, "finish_reason": "eos"},
        )
    with pytest.raises(ValueError, match="role 'assistant'"):
        session.commit(
            plan,
            output_ids=[5],
            output_logprobs=[-0.1],
            weight_versions=[0],
            **{**common, "assistant_message": user("x")},
        )
    with pytest.raises(ValueError, match="token ids"):
        session.commit(
            plan, output_ids=[5, -1], output_logprobs=[-0.1, -0.1], weight_versions=[0, 0], **common
        )
    with pytest.raises(ValueError, match="routed_experts has 1 rows for 2 output tokens"):
        session.commit(
            plan,
            output_ids=[5, 6],
            output_logprobs=[-0.1, -0.1],
            weight_versions=[0, 0],
            routed_experts=[[[1]]],
            **common,
        )
    ckpt = session.commit(
        plan, output_ids=[5, 6], output_logprobs=[-0.1, -0.2], weight_versions=[3, 4], **common
    )
    assert ckpt.token_ids() == [1, 2, 5, 6] and ckpt.prefill_version == 3


def test_deleting_a_session_drops_the_generation_in_flight() -> None:
    engine, session = Engine(), LinearSession()
    m1, r1 = weather_episode()[0]
    plan = session.plan(m1)
    session.close()
    with pytest.raises(SessionClosed, match="while this request was generating"):
        engine.commit(session, plan, r1)
    with pytest.raises(SessionClosed):
        session.plan(m1)
    assert session.trajectories() == []


def test_the_checkpoint_limit_is_enforced() -> None:
    engine, session = Engine(), LinearSession(max_checkpoints=2)
    play(engine, session, turns=2)
    with pytest.raises(SessionFull, match="max_checkpoints"):
        session.plan(weather_episode()[2][0])
