"""Terminal tasks: an instruction, starting files and a test script; the agent gets a shell in a sandbox."""

from miles_envs.terminal.episode import EpisodeLimits, EpisodeOutcome, Policy, PolicyReply, run_episode
from miles_envs.terminal.task import TerminalTask, builtin_tasks_dir, load_task, load_tasks

__all__ = [
    "EpisodeLimits",
    "EpisodeOutcome",
    "Policy",
    "PolicyReply",
    "TerminalTask",
    "builtin_tasks_dir",
    "load_task",
    "load_tasks",
    "run_episode",
]
