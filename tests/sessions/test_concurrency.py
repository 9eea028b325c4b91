"""Concurrent requests to one session: linear refuses the second in flight, branching makes siblings."""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from miles_envs.sessions import BranchingSession, LinearSession, SessionBusy, SessionConflict

from .helpers import Engine, assistant, play, user, weather_episode

THREADS = 8


def _race(fn, n: int = THREADS) -> list[object]:
    """Run ``fn(i)`` on ``n`` threads released together; return results or the exceptions raised."""
    barrier = threading.Barrier(n)

    def call(i: int) -> object:
        barrier.wait()
        try:
            return fn(i)
        except Exception as err:  # collected and checked by the test
            return err

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(call, range(n)))


def test_linear_admits_one_request_in_flight_and_refuses_the_rest() -> None:
    engine, session = Engine(), LinearSession()
    (c1,) = play(engine, session, turns=1)
    m2, r2 = weather_episode()[1]
    results = _race(lambda i: session.plan(m2))
    plans = [r for r in results if not isinstance(r, Exception)]
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(plans) == 1 and len(errors) == THREADS - 1
    assert all(isinstance(e, SessionBusy) and "still generating" in str(e) for e in errors)
    c2 = engine.commit(session, plans[0], r2)
    assert session.trajectories() == [[c1, c2]]
    assert session.plan(weather_episode()[2][0]).parent is c2  # free again after the commit


@pytest.mark.timeout(60)
def test_linear_sequence_stays_consistent_under_contention() -> None:
    """Threads race to add turns from their (possibly outdated) view of the session.

    Each admitted request extends the tail or, when its view is one turn behind, retries the
    latest turn; either way every commit is recorded and the sequence stays append-only.
    """
    engine, session = Engine(), LinearSession(max_checkpoints=10_000)
    lock = threading.Lock()  # only the token counter of the test engine is shared state
    committed: list[int] = []

    def worker(i: int) -> int:
        done = 0
        while done < 5:
            paths = session.trajectories()
            history = (
                [m.to_openai() for m in paths[0][-1].path_messages()]
                if paths
                else [{"role": "user", "content": "go"}]
            )
            request = [*history, user(f"worker {i} turn {done}")] if paths else history
            try:
                plan = session.plan(request)
            except SessionConflict:  # busy, or our view of the tail is already outdated
                continue
            with lock:
                ckpt = engine.commit(session, plan, assistant(f"reply {i}.{done}"), n_out=2)
            committed.append(ckpt.id)
            done += 1
        return done

    assert _race(worker, 4) == [5, 5, 5, 5]
    (path,) = session.trajectories()
    retried = session.stats()["retried_turns"]
    assert len(path) + retried == 20 == len(committed) == len(session.checkpoints())
    for parent, child in itertools.pairwise(path):
        assert child.parent is parent and child.token_ids()[: parent.num_tokens] == parent.token_ids()


def test_branching_generations_from_one_checkpoint_become_siblings() -> None:
    engine, session = Engine(), BranchingSession()
    (c1,) = play(engine, session, turns=1)
    m2 = weather_episode()[1][0]
    lock = threading.Lock()

    def turn(i: int):
        plan = session.plan(m2)
        with lock:
            out = engine.ids(2)
        return session.commit(
            plan,
            prompt_suffix_ids=[7, 7],
            output_ids=out,
            output_logprobs=[-0.5, -0.5],
            weight_versions=[0, 0],
            finish_reason="stop",
            assistant_message=assistant(f"answer {i}"),
        )

    children = _race(turn)
    assert all(c.parent is c1 for c in children)
    assert sorted(c.id for c in children) == list(range(1, THREADS + 1))
    assert set(session.leaves()) == set(children)
    assert len(session.trajectories("all")) == THREADS


@pytest.mark.parametrize("cls", [LinearSession, BranchingSession])
def test_coroutines_with_turn_around_an_await(cls: type) -> None:
    engine, session = Engine(), cls()
    (c1,) = play(engine, session, turns=1)
    m2, r2 = weather_episode()[1]

    async def agent() -> str:
        try:
            with session.turn(m2) as plan:
                await asyncio.sleep(0.01)  # the engine call: the session lock is not held here
                engine.commit(session, plan, r2)
                return "committed"
        except SessionBusy:
            return "busy"

    async def main() -> list[str]:
        return await asyncio.gather(*(agent() for _ in range(5)))

    outcomes = asyncio.run(main())
    if cls is LinearSession:
        assert sorted(outcomes) == ["busy"] * 4 + ["committed"]
    else:
        assert outcomes == ["committed"] * 5
        assert len([c for c in session.checkpoints() if c.parent is c1]) == 5
