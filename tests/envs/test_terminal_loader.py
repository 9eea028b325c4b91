"""Loading terminal tasks: the terminal-bench layout, our own test.sh form, errors, and the data source."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.errors import ConfigError, DataError
from miles.plugins import make_component
from miles.types import ExitReason
from miles_envs.sandbox import SandboxSpec
from miles_envs.sandbox.local import LocalProvider
from miles_envs.terminal import load_task, load_tasks
from miles_envs.terminal.data import ENV_KEY, TASK_KEY, TerminalTaskSource
from miles_envs.terminal.episode import EpisodeOutcome, grade

from .conftest import FAST


def bench_task(root: Path, name: str = "csv-stats") -> Path:
    """A task directory as terminal-bench lays it out (Dockerfile, run-tests.sh, tests/test_outputs.py)."""
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text(
        "instruction: |-\n  Write the number 42 to answer.txt.\n"
        "author_email: someone@example.org\ndifficulty: easy\ncategory: file-operations\n"
        "tags: [files]\nmax_agent_timeout_sec: 180\nmax_test_timeout_sec: 20\n"
        "env: {max_turns: 3}\n"
    )
    (d / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (d / "solution.sh").write_text("#!/bin/bash\necho 42 > answer.txt\n")
    (d / "run-tests.sh").write_text('#!/bin/sh\nexec python3 "$TEST_DIR/test_outputs.py"\n')
    (d / "tests" / "test_outputs.py").write_text("assert open('answer.txt').read().strip() == '42'\n")
    return d


def test_terminal_bench_layout(tmp_path: Path) -> None:
    task = load_task(bench_task(tmp_path))
    assert task.id == "csv-stats" and task.instruction == "Write the number 42 to answer.txt."
    assert task.difficulty == "easy" and task.agent_timeout_s == 180 and task.test_timeout_s == 20
    assert set(task.tests) == {"run-tests.sh", "test_outputs.py"} and task.test_script == "run-tests.sh"
    assert task.solution is not None and "42" in task.solution
    assert task.files == {} and dict(task.env) == {"max_turns": 3}


def test_a_loaded_bench_task_grades_in_the_sandbox(tmp_path: Path, provider: LocalProvider) -> None:
    task = load_task(bench_task(tmp_path))

    async def graded(answer: str) -> EpisodeOutcome:
        sandbox = await provider.create(SandboxSpec(files={"answer.txt": answer}, limits=FAST))
        try:
            return await grade(task, sandbox, EpisodeOutcome(ExitReason.TURN_LIMIT, None))
        finally:
            await sandbox.close()

    assert asyncio.run(graded("42\n")).reward == 1.0
    assert asyncio.run(graded("41\n")).reward == 0.0


def test_a_directory_of_tasks_and_starting_files(tmp_path: Path) -> None:
    bench_task(tmp_path, "a")
    b = bench_task(tmp_path, "b")
    (b / "files" / "data").mkdir(parents=True)
    (b / "files" / "data" / "in.txt").write_bytes(b"\x00binary")
    (tmp_path / "not-a-task").mkdir()
    tasks = load_tasks(tmp_path)
    assert [t.id for t in tasks] == ["a", "b"]
    assert tasks[1].files == {"data/in.txt": b"\x00binary"}
    assert [t.id for t in load_tasks(b)] == ["b"]  # a task directory itself


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda d: (d / "task.yaml").write_text("difficulty: easy\n"), "instruction"),
        (lambda d: (d / "task.yaml").write_text("instruction: [unclosed\n"), "invalid YAML"),
        (lambda d: (d / "run-tests.sh").unlink(), "no test script"),
        (lambda d: (d / "task.yaml").write_text("instruction: x\nmax_agent_timeout_sec: -1\n"), "positive"),
        (lambda d: (d / "tests" / "evil").symlink_to("/etc/passwd"), "symlink"),
        (lambda d: (d / "task.yaml").write_text("instruction: x\nenv: [1]\n"), "env"),
    ],
)
def test_broken_tasks_are_refused_with_the_reason(tmp_path: Path, break_it, message: str) -> None:  # type: ignore[no-untyped-def]
    d = bench_task(tmp_path)
    break_it(d)
    with pytest.raises(DataError, match=message):
        load_task(d)


def test_the_data_source_serves_tasks_with_their_directory_and_env(tmp_path: Path) -> None:
    bench_task(tmp_path, "a")
    source = make_component("data_source", "terminal_tasks", {"path": str(tmp_path), "shuffle": False})
    assert isinstance(source, TerminalTaskSource) and len(source) == 1
    (prompt,) = source.next_prompts(1)
    assert prompt.prompt == [{"role": "user", "content": "Write the number 42 to answer.txt."}]
    assert prompt.metadata[TASK_KEY] == {"id": "a", "dir": str(tmp_path / "a")}
    assert prompt.metadata[ENV_KEY] == {"max_turns": 3}


def test_the_builtin_tasks_can_be_selected() -> None:
    source = TerminalTaskSource("builtin", options={"difficulty": ["hard"]}, shuffle=False)
    assert {t.difficulty for t in source.tasks} == {"hard"} and len(source) >= 3
    picked = TerminalTaskSource("builtin", options={"tasks": ["hello-file", "sort-csv"]})
    assert sorted(t.id for t in picked.tasks) == ["hello-file", "sort-csv"]
    with pytest.raises(ConfigError, match="unknown task ids"):
        TerminalTaskSource("builtin", options={"tasks": ["hello-fiel"]})
