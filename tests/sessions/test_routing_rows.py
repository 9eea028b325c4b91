"""A multi-turn session carries the routing of every position the trainer reads (routing replay, R3).

Each turn's engine call returns the routing of every token it fed, the prompt's included
(``GenerateOutput.prompt_routed_experts``); the turn keeps its suffix's rows
(``session_server.turns.suffix_routing``) and the trajectory puts the first turn's prompt rows in
``Sample.prompt_routed_experts``. Position ``p`` of the whole trajectory must end up with the
routing of position ``p``, whichever turn computed it.
"""

from __future__ import annotations

from miles.routing import NOT_RECORDED, replay_problem, sequence_routing
from miles.types import GenerateOutput, Prompt
from miles_envs.session_server.turns import suffix_routing
from miles_envs.sessions import LinearSession, session_samples
from sessions.helpers import weather_episode


def route(position: int) -> list[list[int]]:
    """A recognisable routing for a sequence position: 2 layers, top-2."""
    return [[position * 4 + layer * 2, position * 4 + layer * 2 + 1] for layer in range(2)]


def engine_answer(input_len: int, n_out: int) -> GenerateOutput:
    """What an engine returns for ``input_len`` prompt tokens: every fed position's routing."""
    return GenerateOutput(
        output_ids=list(range(900, 900 + n_out)),
        output_logprobs=[-0.1] * n_out,
        finish_reason="stop",
        weight_version=0,
        routed_experts=[route(input_len - 1 + j) for j in range(n_out)],
        prompt_routed_experts=[route(p) for p in range(input_len - 1)],
    )


def test_every_position_of_a_three_turn_trajectory_has_its_own_routing() -> None:
    session = LinearSession()
    tokens: list[int] = []  # the session's token sequence so far
    for k, (messages, reply) in enumerate(weather_episode()):
        plan = session.plan(messages)
        prefix = list(plan.prefix_ids) if plan.parent is not None else []
        assert prefix == tokens
        suffix = list(range(100 * (k + 1), 100 * (k + 1) + 3 + 2 * k))
        out = engine_answer(len(prefix) + len(suffix), n_out=4)
        rows = suffix_routing(out, len(prefix), len(suffix))
        assert rows is not None and len(rows) == len(suffix)
        session.commit(
            plan,
            prompt_suffix_ids=suffix,
            output_ids=out.output_ids,
            output_logprobs=out.output_logprobs,
            weight_versions=[0] * 4,
            finish_reason="stop",
            assistant_message=reply,
            routed_experts=out.routed_experts,
            suffix_routed_experts=rows,
        )
        tokens = [*prefix, *suffix, *out.output_ids]
    (sample,) = session_samples(session, Prompt(index=0, prompt="x"))
    assert sample.prompt_ids + sample.response_ids == tokens
    assert sequence_routing(sample) == [route(p) for p in range(len(tokens) - 1)]
    assert replay_problem(sample) is None


def test_a_first_turn_keeps_its_prompt_rows_and_marks_its_first_token_unrecorded() -> None:
    out = engine_answer(5, n_out=2)
    rows = suffix_routing(out, 0, 5)
    assert rows == [[[NOT_RECORDED] * 2] * 2, *[route(p) for p in range(4)]]
    assert suffix_routing(GenerateOutput([1], [-0.1], "stop", 0), 0, 3) is None  # nothing recorded


def test_a_turn_without_suffix_rows_leaves_positions_replay_refuses() -> None:
    session = LinearSession()
    for k, (messages, reply) in enumerate(weather_episode()[:2]):
        plan = session.plan(messages)
        prefix_len = len(plan.prefix_ids) if plan.parent is not None else 0
        suffix = list(range(100 * (k + 1), 100 * (k + 1) + 3))
        out = engine_answer(prefix_len + len(suffix), n_out=2)
        session.commit(
            plan,
            prompt_suffix_ids=suffix,
            output_ids=out.output_ids,
            output_logprobs=out.output_logprobs,
            weight_versions=[0] * 2,
            finish_reason="stop",
            assistant_message=reply,
            routed_experts=out.routed_experts,
            # The first turn's rows only: the second suffix is committed without its routing.
            suffix_routed_experts=suffix_routing(out, prefix_len, len(suffix)) if k == 0 else None,
        )
    (sample,) = session_samples(session, Prompt(index=0, prompt="x"))
    sample.check_aligned()
    assert "3 of 9 positions whose routing was not recorded" in (replay_problem(sample) or "")
