"""The ``agentic:`` recipe section, contributed through ``miles_config_sections`` (miles_envs.hooks).

It lives with the code that reads it: the core validates it like any plugin section (with the
recipe's file and line for a bad key) without knowing what a model family or a session is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles.config.schema import Section


class AgenticSection(Section):
    """Multi-turn and agentic rollouts (``rollout.generate_fn: multi_turn`` or ``agentic``).

    Every key may change when a run resumes (the checkpoint holds no session state).
    """

    family: str = Field(
        ...,
        description="model family that renders the chat template and parses replies (`miles check-family`); "
        "never guessed from the checkpoint; an unregistered name is refused ('generic', the tokenizer's own "
        "template, only when named)",
    )
    session_mode: Literal["linear", "branching"] = Field(
        "linear",
        description="linear: one growing sequence per episode; branching: a tree, one sample per selected leaf",
    )
    leaf_selection: Literal["drop_retries", "all"] = Field(
        "drop_retries", description="branching sessions: which leaves become samples"
    )
    matcher: str = Field(
        "strict", description="replay comparison: strict, json_args, loose, or a matcher name or import path"
    )
    matcher_options: dict[str, Any] = Field(default_factory=dict)
    tools: str | None = Field(
        None, description="tool set the model may call (calculator, or a name or import path); None: no tools"
    )
    tools_options: dict[str, Any] = Field(default_factory=dict)
    agent: str = Field("tool_agent", description="agent function name or import path (generate_fn agentic)")
    agent_options: dict[str, Any] = Field(default_factory=dict)
    agent_timeout_s: float | None = Field(
        None, gt=0, description="an episode whose agent runs longer is cancelled and failed (None: no limit)"
    )
    max_turns: int = Field(8, ge=1, description="model calls per episode")
    max_seq_len: int | None = Field(
        None, ge=2, description="prompt + response tokens per episode; an episode reaching it is truncated"
    )
    server_host: str = Field("127.0.0.1", description="session server address (agentic)")
    server_port: int = Field(0, ge=0, le=65535, description="session server port; 0 picks a free one")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="the run's default thinking switch, as the family's template names it (e.g. "
        "{enable_thinking: false}); a request's chat_template_kwargs override it per key; a key the "
        "family's template does not take is refused",
    )

    @field_validator("family")
    @classmethod
    def _registered_family(cls, name: str) -> str:
        # Like every other wrong name in a recipe, a misspelt family fails validation.
        from miles_envs.families.base import FamilyError
        from miles_envs.families.registry import check_family_name

        try:
            return check_family_name(name)
        except FamilyError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _template_kwargs_of_family(self) -> AgenticSection:
        from miles_envs.families.base import FamilyError
        from miles_envs.families.registry import get_family

        try:
            get_family(self.family).request_thinking(self.chat_template_kwargs)
        except FamilyError as exc:
            raise ValueError(f"chat_template_kwargs: {exc}") from None
        return self
