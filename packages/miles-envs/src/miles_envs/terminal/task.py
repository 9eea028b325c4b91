"""Terminal tasks: an instruction, starting files and a test script whose exit status is the reward.

A task is a directory in the terminal-bench layout::

    <task-id>/
      task.yaml        instruction (required); optional difficulty, max_agent_timeout_sec,
                       max_test_timeout_sec, category, tags, env (per-task agent settings)
      tests/           required: the grader's files, copied into the sandbox only after the agent is done
      run-tests.sh     the test script (terminal-bench); without it, tests/test.sh is the test script
      solution.sh      optional reference solution (the tests check it passes)
      files/           optional starting files, copied into the sandbox root before the agent starts

terminal-bench bakes starting files into a Docker image; here they are plain files under ``files/``
(a Dockerfile, if any, is ignored). At grading, the grader's files (``tests/`` and
``run-tests.sh``) are written to a directory of the sandbox whose name the agent cannot guess, so
nothing it left behind can stand in for them, and the test script runs with ``sh`` from the sandbox
root with ``TEST_DIR`` naming that directory; exit status 0 is reward 1, anything else reward 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from miles.errors import DataError
from miles_envs.sandbox.base import check_relative

#: The directory of the tasks shipped with miles-envs (``path: builtin`` in a recipe).
BUILTIN = "builtin"
TESTS_DIR = "tests"


@dataclass(frozen=True)
class TerminalTask:
    """One task, read from its directory."""

    id: str
    instruction: str
    files: Mapping[str, bytes]  # starting files: sandbox-relative path -> content
    tests: Mapping[str, bytes]  # the grader's files, relative to the grading directory (TEST_DIR)
    test_script: str  # the key in ``tests`` run with sh from the sandbox root; exit 0 = pass
    solution: str | None = None  # reference solution (a shell script), if the task has one
    difficulty: str = "unknown"
    agent_timeout_s: float | None = None  # task.yaml max_agent_timeout_sec
    test_timeout_s: float = 60.0  # task.yaml max_test_timeout_sec
    env: Mapping[str, Any] = field(default_factory=dict)  # per-task agent settings (task.yaml env)
    source: str = ""  # the directory it was read from


def builtin_tasks_dir() -> Path:
    """Where the shipped tasks live: ``miles_envs/terminal/tasks`` in a wheel (hatch force-include),
    ``packages/miles-envs/tasks`` in a source checkout (kept outside ``src`` so the tasks' own
    Python files are not type-checked as part of the package)."""
    packaged = Path(str(resources.files("miles_envs.terminal").joinpath("tasks")))
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[3] / "tasks"
    if checkout.is_dir():
        return checkout
    raise DataError(f"the built-in terminal tasks are missing (looked in {packaged} and {checkout})")


def resolve_tasks_dir(path: str) -> Path:
    """``builtin`` or a directory of task directories (or one task directory)."""
    return builtin_tasks_dir() if path == BUILTIN else Path(path).expanduser()


def _read_tree(root: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for item in sorted(root.rglob("*")):
        if item.is_symlink():
            raise DataError(f"{item}: task files may not be symlinks")
        if item.is_file() and "__pycache__" not in item.parts:
            rel = item.relative_to(root).as_posix()
            check_relative(rel)
            out[rel] = item.read_bytes()
    return out


def load_task(directory: str | Path) -> TerminalTask:
    """The task in ``directory`` (terminal-bench layout); a DataError names what is wrong."""
    root = Path(directory)
    meta_path = root / "task.yaml"
    if not meta_path.is_file():
        raise DataError(f"{root}: not a terminal task (no task.yaml)")
    try:
        meta = yaml.safe_load(meta_path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise DataError(f"{meta_path}: invalid YAML: {err}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path}: expected a mapping, got {type(meta).__name__}")
    instruction = meta.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        # Some terminal-bench versions keep per-variant descriptions instead of one instruction.
        descriptions = meta.get("descriptions")
        if isinstance(descriptions, list) and descriptions and isinstance(descriptions[0], dict):
            instruction = descriptions[0].get("description")
    if not isinstance(instruction, str) or not instruction.strip():
        raise DataError(f"{meta_path}: needs a non-empty 'instruction'")
    tests_root = root / TESTS_DIR
    if not tests_root.is_dir():
        raise DataError(f"{root}: a terminal task needs a {TESTS_DIR}/ directory with its test script")
    tests = _read_tree(tests_root)
    run_tests = root / "run-tests.sh"
    if run_tests.is_file():
        if "run-tests.sh" in tests:
            raise DataError(f"{root}: both run-tests.sh and {TESTS_DIR}/run-tests.sh; keep one")
        tests["run-tests.sh"] = run_tests.read_bytes()
        test_script = "run-tests.sh"
    elif "test.sh" in tests:
        test_script = "test.sh"
    else:
        raise DataError(f"{root}: no test script (run-tests.sh or tests/test.sh)")
    files_root = root / "files"
    files = _read_tree(files_root) if files_root.is_dir() else {}
    solution_path = root / "solution.sh"
    env = meta.get("env") or {}
    if not isinstance(env, dict):
        raise DataError(f"{meta_path}: 'env' must be a mapping of agent settings")
    return TerminalTask(
        id=str(meta.get("id") or root.name),
        instruction=instruction.strip(),
        files=files,
        tests=tests,
        test_script=test_script,
        solution=solution_path.read_text(encoding="utf-8") if solution_path.is_file() else None,
        difficulty=str(meta.get("difficulty", "unknown")),
        agent_timeout_s=_seconds(meta, "max_agent_timeout_sec", meta_path),
        test_timeout_s=_seconds(meta, "max_test_timeout_sec", meta_path) or 60.0,
        env=env,
        source=str(root),
    )


def _seconds(meta: Mapping[str, Any], key: str, where: Path) -> float | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise DataError(f"{where}: {key} must be a positive number of seconds, got {value!r}")
    return float(value)


def load_tasks(path: str | Path) -> list[TerminalTask]:
    """Every task under ``path``: a task directory itself, or a directory of task directories."""
    root = resolve_tasks_dir(str(path)) if isinstance(path, str) else path
    if not root.is_dir():
        raise DataError(f"terminal tasks: {root} is not a directory")
    if (root / "task.yaml").is_file():
        return [load_task(root)]
    tasks = [load_task(d) for d in sorted(root.iterdir()) if d.is_dir() and (d / "task.yaml").is_file()]
    if not tasks:
        raise DataError(f"terminal tasks: no task directories (with a task.yaml) under {root}")
    ids = [t.id for t in tasks]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise DataError(f"terminal tasks under {root}: duplicate ids {dupes}")
    return tasks
