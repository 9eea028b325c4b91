"""The shipped terminal tasks, in a real sandbox: each reference solution passes its test script,
and the untouched starting files (the empty solution) fail it."""

from __future__ import annotations

import asyncio

import pytest

from miles.types import ExitReason
from miles_envs.sandbox import SandboxSpec
from miles_envs.sandbox.local import LocalProvider
from miles_envs.terminal import TerminalTask, load_tasks
from miles_envs.terminal.episode import EpisodeOutcome, grade

from .conftest import FAST

TASKS = load_tasks("builtin")


def test_at_least_twenty_tasks_of_every_difficulty() -> None:
    assert len(TASKS) >= 20
    assert {t.difficulty for t in TASKS} == {"easy", "medium", "hard"}
    assert all(t.solution for t in TASKS), "every shipped task has a reference solution"


async def _graded(provider: LocalProvider, task: TerminalTask, solution: str | None) -> EpisodeOutcome:
    sandbox = await provider.create(SandboxSpec(files=dict(task.files), limits=FAST))
    try:
        if solution is not None:
            await sandbox.write_file("solution.sh", solution)
            done = await sandbox.exec("sh solution.sh && rm solution.sh")
            assert done.ok, (task.id, done)
        return await grade(task, sandbox, EpisodeOutcome(ExitReason.COMPLETED, None))
    finally:
        await sandbox.close()


@pytest.mark.parametrize("task", TASKS, ids=[t.id for t in TASKS])
def test_reference_solution_passes_and_empty_solution_fails(
    provider: LocalProvider, task: TerminalTask
) -> None:
    async def both() -> tuple[EpisodeOutcome, EpisodeOutcome]:
        return await asyncio.gather(_graded(provider, task, task.solution), _graded(provider, task, None))

    solved, empty = asyncio.run(both())
    assert solved.reward == 1.0 and solved.test_exit_code == 0, (task.id, solved)
    assert empty.reward == 0.0 and empty.test_exit_code not in (0, None), (task.id, empty)
    assert solved.exit_reason is ExitReason.COMPLETED
