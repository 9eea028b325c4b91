"""How miles-envs joins a run: exactly the hooks a third-party plugin would implement.

The ``agentic:`` recipe section (``miles_config_sections``), the checks of what the generate
function and that section need from each other (``miles_check_config``), the section's component
options (``miles_option_slots``) and the agentic rollout service, which runs the session server
(``miles_rollout_services``). Its components (generate functions, agents, tool sets, matchers,
the ``agent`` reward) and its commands (``miles serve``, ``miles check-family``) are entry
points in this package's pyproject.
"""

from __future__ import annotations

from typing import Any

from miles import hookimpl
from miles.config.sections import ConfigSection


@hookimpl
def miles_config_sections() -> list[ConfigSection]:
    from miles_envs.config import AgenticSection
    from miles_envs.context import SECTION

    return [
        ConfigSection(
            name=SECTION,
            model=AgenticSection,
            description="model family, sessions, tools and agent of multi-turn / agentic rollouts",
            resume_mutable=frozenset(AgenticSection.model_fields),
        )
    ]


@hookimpl
def miles_check_config(config: Any) -> None:
    from miles_envs.service import check_agentic

    check_agentic(config)


@hookimpl
def miles_option_slots(config: Any) -> list[Any]:
    from miles_envs.service import agentic_option_slots

    return agentic_option_slots(config)


@hookimpl
def miles_rollout_services(config: Any) -> list[Any]:
    from miles_envs.service import AgenticService, resolve_agentic

    context = resolve_agentic(config)
    return [] if context is None else [AgenticService(context)]
