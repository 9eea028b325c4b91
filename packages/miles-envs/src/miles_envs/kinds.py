"""The component kinds miles-envs adds to the recipe's vocabulary (entry points in ``miles.kinds``).

Imported by the core's loader when one of these kinds is first named, so it imports nothing heavy: the
protocols are named by import path.
"""

from __future__ import annotations

from miles.plugins import ComponentKind

# An agent function plays one episode against the session server: ``agent(task)`` with an
# ``AgentTask``; its recipe options reach it whole, as ``task.options``.
AGENT = ComponentKind(group="miles.agents", called_with=("task",), options="mapping")
# The tools a multi-turn episode may call; built with its options as keyword arguments.
TOOLSET = ComponentKind(group="miles.toolsets", protocol="miles_envs.interfaces:ToolSet")
# Whether a message a client sends again matches the one the session recorded: ``matcher(recorded, incoming)``.
SESSION_MATCHER = ComponentKind(group="miles.session_matchers", called_with=("recorded", "incoming"))
