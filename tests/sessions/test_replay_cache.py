"""The replay cache: a resent history is recognised without re-judging it, with every rule intact.

A session remembers the form in which the matcher accepted each resent message and skips
parsing and matching when the same JSON value comes again. These tests pin what must not
change: token fields stay ignored, an earlier difference is still refused (linear) or
branches (branching), and the matcher still judges every message it has not accepted in
exactly that form.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest

from miles_envs.sessions import (
    BranchingSession,
    HistoryDiverged,
    LinearSession,
    Message,
    json_args,
    strict,
)
from miles_envs.sessions.messages import MAX_KEY_DEPTH, replay_key

from .helpers import SYSTEM, USER, Engine, assistant, tool, tool_call, user


class Counting:
    """A matcher that delegates to ``inner`` and counts the pairs it was asked about, by role."""

    def __init__(self, inner: Any = strict) -> None:
        self.inner = inner
        self.asked: Counter[str] = Counter()

    def __call__(self, recorded: Message, incoming: Message) -> bool:
        self.asked[incoming.role] += 1
        return self.inner(recorded, incoming)

    def reset(self) -> int:
        total = sum(self.asked.values())
        self.asked.clear()
        return total


def call_reply(turn: int) -> dict[str, Any]:
    return assistant("", [tool_call(f"call_{turn}", "search", f'{{"q": "query {turn}"}}')])


def grow(engine: Engine, session: Any, turns: int) -> list[dict[str, Any]]:
    """Play ``turns`` tool-calling turns, resending the history as fresh copies each time (like JSON
    decoding does); returns the messages of the next request."""
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    for turn in range(turns):
        engine.run(session, copy.deepcopy(messages), call_reply(turn))
        messages = [*messages, call_reply(turn), tool(f"call_{turn}", f"result {turn}")]
    return messages


@pytest.mark.parametrize("cls", [LinearSession, BranchingSession])
def test_the_matcher_judges_only_what_it_has_not_accepted_in_that_form(cls: type) -> None:
    matcher = Counting()
    engine, session = Engine(), cls(matcher=matcher)
    asked = []
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    for turn in range(8):
        matcher.reset()
        engine.run(session, copy.deepcopy(messages), call_reply(turn))
        asked.append(matcher.reset())
        messages = [*messages, call_reply(turn), tool(f"call_{turn}", f"result {turn}")]
    # From the third turn on, only the latest turn's messages are new to the matcher: the cost
    # of judging the replay stays flat instead of growing with the history.
    assert asked[3:] == [asked[2]] * 5 and asked[2] <= 3, asked


@pytest.mark.parametrize("cls", [LinearSession, BranchingSession])
def test_a_message_resent_in_another_form_goes_to_the_matcher_again(cls: type) -> None:
    matcher = Counting(json_args)
    engine, session = Engine(), cls(matcher=matcher)
    messages = grow(engine, session, 4)
    session.abandon(session.plan(messages))  # every replay is recognised now
    matcher.reset()
    # The agent re-serialises one early tool call: json_args still accepts it, but only after
    # being asked; the rest of the history is recognised as before.
    reserialised = copy.deepcopy(messages)
    reserialised[2]["tool_calls"][0]["function"]["arguments"] = '{"q":"query 0"}'
    plan = session.plan(reserialised)
    # Linear sessions judge message by message; branching ones judge a checkpoint's turn as a whole
    # (the first turn: system, user, and the reply).
    turn = Counter(assistant=1) if cls is LinearSession else Counter(system=1, user=1, assistant=1)
    assert matcher.asked == turn
    assert plan.parent is not None and plan.parent.depth == 4
    # The recorded message stays authoritative, whatever form was replayed.
    assert plan.history[2].tool_calls[0].arguments == '{"q": "query 0"}'


@pytest.mark.parametrize("cls", [LinearSession, BranchingSession])
def test_token_fields_the_agent_adds_to_a_recognised_history_are_still_ignored(cls: type) -> None:
    engine, session = Engine(), cls()
    messages = grow(engine, session, 3)
    before = session.plan(messages)
    session.abandon(before)
    noisy = copy.deepcopy(messages)
    noisy[2] |= {"prompt_token_ids": [1, 2, 3], "logprobs": {"content": [{"logprob": -0.5}]}, "refusal": None}
    plan = session.plan(noisy)
    assert plan.parent is before.parent and plan.prefix_ids == before.prefix_ids
    assert plan.messages == before.messages
    session.abandon(plan)
    # ... and the form with the token fields is recognised from now on, like any other.
    again = session.plan(copy.deepcopy(noisy))
    assert again.parent is before.parent


def test_linear_an_earlier_difference_is_refused_even_in_a_recognised_history() -> None:
    engine, session = Engine(), LinearSession()
    messages = grow(engine, session, 4)
    session.abandon(session.plan(messages))
    edited = copy.deepcopy(messages)
    edited[3]["content"] = "result 0, edited"  # the tool result that opened turn 2 (of 4)
    with pytest.raises(HistoryDiverged) as err:
        session.plan(edited)
    assert err.value.index == 3 and "content" in str(err.value)
    # A differing call id is refused the same way (no key is shared between places).
    swapped = copy.deepcopy(messages)
    swapped[2]["tool_calls"][0]["id"] = "call_x"
    with pytest.raises(HistoryDiverged) as err:
        session.plan(swapped)
    assert err.value.index == 2


def test_branching_an_earlier_difference_opens_a_branch_at_the_right_place() -> None:
    engine, session = Engine(), BranchingSession()
    messages = grow(engine, session, 4)
    edited = copy.deepcopy(messages)
    edited[5]["content"] = "result 1, edited"  # the tool result that opened turn 3
    plan = session.plan(edited)
    assert plan.parent is not None and plan.parent.depth == 2  # turn 3's path no longer matches
    assert plan.new_messages[0].content == "result 1, edited"


def test_a_message_edited_in_place_after_sending_is_not_mistaken_for_its_old_form() -> None:
    engine, session = Engine(), LinearSession()
    messages = [SYSTEM, USER]
    engine.run(session, messages, call_reply(0))
    history = [*messages, call_reply(0), tool("call_0", "result 0")]
    engine.run(session, history, call_reply(1))  # SYSTEM and USER are recognised from now on
    USER_EDITED = history[1]
    original = USER_EDITED["content"]
    try:
        USER_EDITED["content"] = "a rewritten question"  # the very dict object the session has seen
        with pytest.raises(HistoryDiverged) as err:
            session.plan([*history, call_reply(1), tool("call_1", "r")])
        assert err.value.index == 1
    finally:
        USER_EDITED["content"] = original


@pytest.mark.parametrize("value", [1.0, True])
def test_arguments_sent_as_an_object_are_judged_every_time(value: object) -> None:
    # Python has 1 == 1.0 == True, strict does not: such a message gets no replay key.
    engine, session = Engine(), LinearSession()
    sent = assistant("", [tool_call("c1", "f", {"n": 1})])  # type: ignore[arg-type]
    engine.run(session, [USER], sent)
    engine.run(session, [USER, copy.deepcopy(sent), user("again")], assistant("ok"))
    changed = copy.deepcopy(sent)
    changed["tool_calls"][0]["function"]["arguments"] = {"n": value}
    with pytest.raises(HistoryDiverged) as err:
        session.plan([USER, changed, user("again"), assistant("ok"), user("more")])
    assert err.value.index == 1


def test_a_matcher_that_refuses_identical_messages_is_not_overruled() -> None:
    # Reuse needs the matcher to be a function of the pair, not to accept a message as itself:
    # a verdict is only reused for the exact pair it was given for.
    def no_tool_replays(recorded: Message, incoming: Message) -> bool:
        return recorded.role != "tool" and strict(recorded, incoming)

    engine, session = Engine(), LinearSession(matcher=no_tool_replays)
    c1 = engine.run(session, [SYSTEM, USER], call_reply(0))
    history = [SYSTEM, USER, call_reply(0), tool("call_0", "r0")]
    c2 = engine.run(session, copy.deepcopy(history), call_reply(1))
    for _ in range(2):
        # The recorded tool result is resent as it was sent, yet the matcher refuses it: the request
        # diverges inside turn 2, so it retries that turn instead of extending it.
        plan = session.plan([*copy.deepcopy(history), call_reply(1), tool("call_1", "r1")])
        assert plan.parent is c1 and plan.replaces is c2
        session.abandon(plan)


def test_a_retried_turn_forgets_the_replays_of_the_turn_it_replaces() -> None:
    engine, session = Engine(), LinearSession()
    m1 = [SYSTEM, USER]
    c1 = engine.run(session, m1, call_reply(0))
    m2 = [*m1, call_reply(0), tool("call_0", "r0")]
    c2 = engine.run(session, m2, assistant("first answer"))
    # Turn 3 resends turn 2's reply: it is recognised from now on...
    m3 = [*m2, assistant("first answer"), user("thanks")]
    session.abandon(session.plan(m3))
    # ...until a retry of turn 2 replaces that reply.
    c2b = engine.commit(session, session.plan(m2), assistant("second answer"))
    assert session.trajectories() == [[c1, c2b]]
    plan = session.plan(m3)  # the old reply now diverges inside the latest turn: a retry again
    assert plan.parent is c1 and plan.replaces is c2b
    assert c2 in session.checkpoints()


def test_replay_keys_exist_only_where_equality_is_exact() -> None:
    raw = {"role": "assistant", "content": "", "tool_calls": [tool_call("c1", "f", '{"a": 1}')], "n": 1}
    key = replay_key(raw, Message.from_openai(raw))
    assert key == raw and key is not raw and key["tool_calls"] is not raw["tool_calls"]  # a deep copy
    for not_exact in (
        {**raw, "tool_calls": [tool_call("c1", "f", {"a": 1})]},  # numbers read by the matcher
        {**raw, "extra": (1, 2)},  # a tuple would equal nothing JSON decodes, but is not JSON
        {**raw, "extra": {1: "x"}},  # a non-string key
    ):
        assert replay_key(not_exact, Message.from_openai(not_exact)) is None, not_exact
    message = Message.from_openai(raw)
    assert replay_key(message, message) is None  # only plain dicts
    deep: Any = "x"
    for _ in range(MAX_KEY_DEPTH - 1):  # the message itself is the first level
        deep = [deep]
    assert replay_key({**raw, "extra": deep}, message) is not None
    assert replay_key({**raw, "extra": [deep]}, message) is None


@pytest.mark.parametrize("cls", [LinearSession, BranchingSession])
def test_a_message_list_that_is_a_tuple_of_messages_still_plans(cls: type) -> None:
    engine, session = Engine(), cls()
    engine.run(session, (SYSTEM, USER), call_reply(0))  # type: ignore[arg-type]
    messages = (SYSTEM, USER, Message.from_openai(call_reply(0)), tool("call_0", "r"))
    plan = session.plan(messages)
    assert plan.parent is not None and [m.role for m in plan.new_messages] == ["tool"]
