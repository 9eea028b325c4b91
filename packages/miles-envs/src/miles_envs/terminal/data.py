"""``terminal_tasks``: a data source over a directory of terminal tasks (or the built-in ones).

Each task is one prompt: its instruction (through ``data.prompt_template``), no label, and
``metadata["terminal_task"]`` naming the task directory, which the ``terminal`` agent loads to
build the sandbox and grade the episode. A task's ``env`` settings (``task.yaml``) ride along as
``metadata["env"]``: per-sample overrides of the agent's options.

From a recipe::

    data:
      source: terminal_tasks
      path: builtin            # or a directory of terminal-bench task directories
      options: {tasks: [hello-file, count-lines]}   # optional: a subset, by id
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import Field

from miles.builtins.data.records import PromptFormat, PromptPool, Where, map_records
from miles.capabilities import ComponentOptions
from miles.errors import ConfigError
from miles_envs.terminal.task import BUILTIN, TerminalTask, load_tasks

TASK_KEY = "terminal_task"
ENV_KEY = "env"


class TerminalTasksOptions(ComponentOptions):
    """``data.options`` of ``terminal_tasks``."""

    tasks: list[str] | None = Field(None, description="task ids to keep (default: every task found)")
    difficulty: list[str] | None = Field(None, description="difficulties to keep (easy, medium, hard)")


class TerminalTaskSource(PromptPool):
    """One prompt per terminal task under ``path`` (``builtin``: the tasks shipped with miles-envs)."""

    Options = TerminalTasksOptions

    def __init__(
        self,
        path: str = BUILTIN,
        *,
        prompt_key: str = "prompt",
        label_key: str | None = "label",
        metadata_keys: Sequence[str] = (),
        shuffle: bool = True,
        seed: int = 0,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        options: dict[str, Any] | None = None,
    ) -> None:
        opts = TerminalTasksOptions.model_validate(options or {})
        tasks = select(load_tasks(path), opts)
        fmt = PromptFormat(
            "prompt", None, (TASK_KEY, ENV_KEY), apply_chat_template, system_prompt, prompt_template
        )
        self.tasks = tasks
        super().__init__(
            map_records(_records(tasks), fmt), shuffle=shuffle, seed=seed, name=f"terminal tasks {path!r}"
        )


def select(tasks: list[TerminalTask], opts: TerminalTasksOptions) -> list[TerminalTask]:
    if opts.tasks is not None:
        known = {t.id for t in tasks}
        missing = sorted(set(opts.tasks) - known)
        if missing:
            raise ConfigError(
                f"terminal_tasks: unknown task ids {missing}; known: {', '.join(sorted(known))}"
            )
        tasks = [t for t in tasks if t.id in set(opts.tasks)]
    if opts.difficulty is not None:
        tasks = [t for t in tasks if t.difficulty in set(opts.difficulty)]
    if not tasks:
        raise ConfigError("terminal_tasks: the selection (data.options) keeps no task")
    return tasks


def _records(tasks: list[TerminalTask]) -> Iterator[tuple[dict[str, Any], Where]]:
    for task in tasks:
        record = {
            "prompt": task.instruction,
            TASK_KEY: {"id": task.id, "dir": task.source},
            ENV_KEY: dict(task.env),
        }
        yield record, _where(task)


def _where(task: TerminalTask) -> Where:
    return lambda: f"terminal task {task.id} ({task.source})"
