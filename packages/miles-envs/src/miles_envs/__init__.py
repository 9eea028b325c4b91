"""Miles' agentic package: the session server, model families, sessions, the multi-turn and agentic
generate functions, agents, tool sets, sandboxes and the terminal-task environment.

It joins a run like any third-party plugin (its entry points and ``miles_envs.hooks``); the core
never imports it.
"""
