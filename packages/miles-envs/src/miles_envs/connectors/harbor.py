"""The Harbor connector: Harbor tasks as a data source, each episode a Harbor trial.

A Harbor task is a directory: ``task.toml``, ``instruction.md``, ``environment/`` (its
Dockerfile), ``tests/test.sh`` (writes the reward to ``/logs/verifier/reward.txt``) and
optionally ``solution/``. The ``harbor_tasks`` data source makes one prompt per task (its
instruction); the ``harbor`` agent runs one Harbor trial per episode with ``harbor trial start``:
Harbor builds and starts the task's environment, runs the agent, runs the verifier and writes
``result.json``, whose reward is the episode's (read it with ``rollout.reward: agent``).

The agent inside the trial is ``miles_harbor_agent:MilesShellAgent`` (``harbor_bridge/``): the
``terminal`` agent's shell loop as a Harbor agent, whose model is the episode's session-server
``base_url``, so every token the trainer sees is the engine's. Harbor (Python 3.12 and newer) runs
in its own environment: the connector runs its command line and imports none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import tomllib
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from miles.builtins.data.records import PromptFormat, PromptPool, Where, map_records
from miles.capabilities import ComponentOptions, declare_options
from miles.errors import ConfigError, DataError
from miles.types import ExitReason
from miles_envs.interfaces import AgentResult, AgentTask
from miles_envs.terminal.shell import SHELL_SPEC

TASK_KEY = "harbor_task"
BRIDGE_DIR = Path(__file__).with_name("harbor_bridge")
BRIDGE_AGENT = "miles_harbor_agent:MilesShellAgent"
CONFIG_ENV = "MILES_HARBOR_AGENT"

# Harbor's result.json, read by phase: an exception before the agent ran is the environment's
# (it could not be built or started), one after it is the verifier's.
_WALL_CLOCK = {"AgentTimeoutError"}


# --- the data source --------------------------------------------------------------------------


class HarborTasksOptions(ComponentOptions):
    """``data.options`` of ``harbor_tasks``."""

    tasks: list[str] | None = Field(
        None, description="task directory names to keep (default: every task found)"
    )


def find_tasks(path: str) -> list[Path]:
    """The Harbor task directories at ``path``: the directory itself, or its subdirectories that are tasks."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DataError(f"harbor_tasks: {path!r} is not a directory")
    if (root / "task.toml").is_file():
        return [root.resolve()]
    found = sorted(p.resolve() for p in root.iterdir() if (p / "task.toml").is_file())
    if not found:
        raise DataError(f"harbor_tasks: no Harbor task (a directory with task.toml) in {path!r}")
    return found


class HarborTaskSource(PromptPool):
    """One prompt per Harbor task directory under ``path``: its ``instruction.md``."""

    Options = HarborTasksOptions

    def __init__(
        self,
        path: str,
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
        del prompt_key, label_key, metadata_keys  # the task layout decides; the verifier grades
        opts = HarborTasksOptions.model_validate(options or {})
        tasks = find_tasks(path)
        if opts.tasks is not None:
            missing = sorted(set(opts.tasks) - {t.name for t in tasks})
            if missing:
                raise ConfigError(
                    f"harbor_tasks: unknown tasks {missing}; found {sorted(t.name for t in tasks)}"
                )
            tasks = [t for t in tasks if t.name in set(opts.tasks)]
        fmt = PromptFormat("prompt", None, (TASK_KEY,), apply_chat_template, system_prompt, prompt_template)
        super().__init__(
            map_records(_records(tasks), fmt), shuffle=shuffle, seed=seed, name=f"Harbor tasks {path!r}"
        )


def _records(tasks: list[Path]) -> Iterator[tuple[dict[str, Any], Where]]:
    for task in tasks:

        def where(task: Path = task) -> str:
            return f"Harbor task {str(task)!r}"

        try:
            config = tomllib.loads((task / "task.toml").read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise DataError(f"{where()}: task.toml cannot be read: {exc}") from None
        instruction = task / "instruction.md"
        if not instruction.is_file() or not instruction.read_text().strip():
            raise DataError(f"{where()}: no instruction.md (or it is empty)")
        if not (task / "tests" / "test.sh").is_file():
            raise DataError(f"{where()}: no tests/test.sh")
        name = (config.get("task") or {}).get("name") or task.name
        yield {"prompt": instruction.read_text().strip(), TASK_KEY: {"dir": str(task), "name": name}}, where


# --- the agent --------------------------------------------------------------------------------


class HarborOptions(ComponentOptions):
    """``agentic.agent_options`` of the ``harbor`` agent."""

    harbor: str = Field("harbor", description="the harbor command (Harbor's own environment, Python >= 3.12)")
    environment: str = Field(
        "docker", description="harbor trial start -e: docker, podman, ... or an import path"
    )
    extra_compose: list[str] = Field(default_factory=list, description="--extra-docker-compose overlay files")
    environment_kwargs: dict[str, str] = Field(
        default_factory=dict, description="--environment-kwarg key=value"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables of the harbor process"
    )
    max_turns: int | None = Field(
        None, gt=0, description="model calls per episode; default: agentic.max_turns"
    )
    command_timeout_s: int = Field(30, gt=0, description="one shell command")
    tool_timeout_budget: int = Field(
        2, ge=0, description="command timeouts tolerated; one more ends the episode"
    )
    output_chars: int = Field(16384, gt=0, description="characters of a command's output the model reads")
    reward_key: str = Field("reward", description="the verifier's reward to use (reward.txt is 'reward')")
    trials_dir: str | None = Field(
        None, description="where Harbor writes its trials (default: a temporary directory)"
    )
    keep_trials: bool = Field(False, description="keep each trial's directory (logs, result.json)")
    model: str = Field("policy", description="the model name sent to the session server")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds one chat completion may take")
    trial_timeout_s: float = Field(3600.0, gt=0, description="seconds the whole harbor trial may take")


@declare_options(HarborOptions)
async def harbor_agent(task: AgentTask) -> AgentResult:
    """Run one Harbor trial of the prompt's task, its agent playing through the session server."""
    opts = HarborOptions.model_validate(task.options)
    spec = task.metadata.get(TASK_KEY)
    if not isinstance(spec, dict) or "dir" not in spec:
        raise ConfigError("the 'harbor' agent needs metadata['harbor_task'] (data.source: harbor_tasks)")
    harbor = shutil.which(opts.harbor)
    if harbor is None:
        raise ConfigError(
            f"the 'harbor' agent cannot find the harbor command {opts.harbor!r}: install Harbor (Python >= 3.12) "
            "in its own environment, e.g. `uv tool install harbor`, and name it in agent_options.harbor"
        )
    name = f"miles-{uuid.uuid4().hex[:12]}"
    trials = Path(opts.trials_dir) if opts.trials_dir else Path(tempfile.mkdtemp(prefix="miles-harbor-"))
    trials.mkdir(parents=True, exist_ok=True)
    argv = [harbor, "trial", "start", "-p", spec["dir"], "-a", BRIDGE_AGENT, "-e", opts.environment]
    argv += ["--trials-dir", str(trials), "--trial-name", name]
    for overlay in opts.extra_compose:
        argv += ["--extra-docker-compose", overlay]
    for key, value in opts.environment_kwargs.items():
        argv += ["--environment-kwarg", f"{key}={value}"]
    config = {
        "base_url": task.base_url,
        "messages": task.messages,
        "tool": SHELL_SPEC,
        "request": task.request,
        "model": opts.model,
        "max_turns": opts.max_turns or task.max_turns,
        "request_timeout_s": opts.request_timeout_s,
        "command_timeout_s": opts.command_timeout_s,
        "tool_timeout_budget": opts.tool_timeout_budget,
        "output_chars": opts.output_chars,
    }
    env = {
        **os.environ,
        **opts.env,
        CONFIG_ENV: json.dumps(config),
        # The bridge agent is imported by Harbor; tools installed beside harbor (podman-compose) come first.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BRIDGE_DIR), os.environ.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([str(Path(harbor).parent), opts.env.get("PATH", os.environ.get("PATH", ""))]),
    }
    try:
        output = await _run(argv, env, opts.trial_timeout_s)
        result_file = trials / name / "result.json"
        if not result_file.is_file():
            return _failed(ExitReason.ENVIRONMENT_ERROR, f"harbor wrote no result.json:\n{output[-3000:]}")
        return outcome(json.loads(result_file.read_text()), opts.reward_key)
    finally:
        if not opts.keep_trials:
            shutil.rmtree(trials / name, ignore_errors=True)
            if opts.trials_dir is None:
                shutil.rmtree(trials, ignore_errors=True)


async def _run(argv: list[str], env: dict[str, str], timeout_s: float) -> str:
    """Run harbor to the end; a cancelled episode stops it (SIGINT first: Harbor then removes its containers)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        raise
    return out.decode(errors="replace")


def outcome(result: dict[str, Any], reward_key: str = "reward") -> AgentResult:
    """A Harbor ``result.json`` as the episode's result (reward, exit reason, metadata)."""
    agent_meta = dict((result.get("agent_result") or {}).get("metadata") or {})
    exception = result.get("exception_info") or {}
    kind, message = exception.get("exception_type"), exception.get("exception_message", "")
    rewards = (result.get("verifier_result") or {}).get("rewards")
    metadata = {
        k: agent_meta[k]
        for k in ("turns", "tool_calls", "tool_time_s", "command_timeouts")
        if k in agent_meta
    }
    metadata["harbor_trial"] = result.get("trial_name")
    if kind is not None:
        metadata["harbor_exception"] = kind
    if agent_meta.get("exit_reason") == "environment_error":
        return _failed(ExitReason.ENVIRONMENT_ERROR, str(agent_meta.get("failure")), metadata)
    if kind is not None and kind not in _WALL_CLOCK:
        if result.get("agent_execution") is None:
            return _failed(
                ExitReason.SANDBOX_DIED, f"Harbor's environment failed: {kind}: {message}", metadata
            )
        if rewards is None and result.get("verifier") is not None:
            return _failed(ExitReason.SANDBOX_DIED, f"Harbor's verifier failed: {kind}: {message}", metadata)
        return AgentResult(
            reward=None,
            metadata=metadata,
            failure=f"the agent raised in the Harbor trial: {kind}: {message}",
            exit_reason=ExitReason.AGENT_ERROR,
        )
    if not rewards or reward_key not in rewards:
        return _failed(
            ExitReason.SANDBOX_DIED, f"Harbor's verifier gave no {reward_key!r} reward: {rewards}", metadata
        )
    metadata["harbor_rewards"] = rewards
    reason = (
        ExitReason.WALL_CLOCK
        if kind in _WALL_CLOCK
        else ExitReason(agent_meta.get("exit_reason") or "completed")
    )
    return AgentResult(reward=float(rewards[reward_key]), metadata=metadata, exit_reason=reason)


def _failed(reason: ExitReason, failure: str, metadata: dict[str, Any] | None = None) -> AgentResult:
    return AgentResult(reward=None, metadata=metadata or {}, failure=failure, exit_reason=reason)
