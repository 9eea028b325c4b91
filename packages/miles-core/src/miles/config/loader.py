"""Load a recipe: find it, parse it, apply ``--set`` overrides, validate it, check its components.

The root model is ``MilesConfig`` extended with the sections plugins contribute
(``miles_config_sections``), so a plugin's options are validated with the rest of the
recipe, before anything heavy starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pluggy
from pydantic import BaseModel, Field, ValidationError, create_model

from miles.config.options import RecipeOrigin, remember_origin
from miles.config.overrides import apply_overrides, parse_override
from miles.config.problems import KeyPath, describe_errors
from miles.config.recipes import find_recipe
from miles.config.schema import MilesConfig
from miles.config.sections import ConfigSection
from miles.config.yaml_io import dump_yaml, parse_yaml
from miles.errors import ComponentError, ConfigError


class RecipeError(ConfigError):
    """A recipe failed validation; ``problems`` holds one sentence per problem."""

    def __init__(self, recipe: str, problems: list[str]) -> None:
        self.recipe = recipe
        self.problems = problems
        if len(problems) == 1:
            message = f"recipe {recipe}: {problems[0]}"
        else:
            message = f"recipe {recipe} has {len(problems)} problems:\n" + "\n".join(
                f"  - {p}" for p in problems
            )
        super().__init__(message)


def config_model(sections: dict[str, ConfigSection]) -> type[MilesConfig]:
    """``MilesConfig`` plus one optional top-level field per plugin section."""
    if not sections:
        return MilesConfig
    fields: dict[str, Any] = {}
    for name, section in sorted(sections.items()):
        if _constructible(section.model):
            fields[name] = (
                section.model,
                Field(default_factory=section.model, description=section.description),
            )
        else:
            # A section with required keys is present only when the recipe writes it, so that
            # installing a plugin never breaks recipes that do not use it.
            fields[name] = (section.model | None, Field(None, description=section.description))
    # Named like its base so the JSON schema's title stays "MilesConfig"; defined in this module
    # (not schema.py) so that pickle refuses it instead of silently restoring the base class.
    return create_model("MilesConfig", __base__=MilesConfig, __module__=__name__, **fields)


def _constructible(model: type[BaseModel]) -> bool:
    try:
        model()
    except ValidationError:
        return False
    return True


def plugin_config_model(pm: pluggy.PluginManager | None = None) -> type[MilesConfig]:
    """The root model for the installed plugins (``pm`` defaults to the process's manager)."""
    from miles.plugins import collect_config_sections, get_plugin_manager

    return config_model(collect_config_sections(pm if pm is not None else get_plugin_manager()))


def load_recipe(
    ref: str, overrides: Sequence[str] = (), pm: pluggy.PluginManager | None = None
) -> MilesConfig:
    """The validated config of recipe ``ref`` (a recipe name or a YAML file) with ``--set`` overrides.

    Raises ``ConfigError`` (one sentence per problem) for a missing recipe, malformed
    YAML, unknown keys, or invalid values. Components are checked separately by
    ``validate_components``.
    """
    source = find_recipe(ref)
    parsed = parse_yaml(source.text, source.display)
    data = parsed.data if parsed.data is not None else {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source.display}: a recipe is a mapping of sections (run:, model:, data:, ...), "
            f"got a {type(data).__name__}"
        )
    where: dict[KeyPath, str] = {path: f"{source.display}:{line}" for path, line in parsed.lines.items()}
    parsed_overrides = [parse_override(text) for text in overrides]
    data = apply_overrides(data, parsed_overrides)
    for override in parsed_overrides:
        where[override.path] = f"--set {override.text}"
    data["recipe"] = source.ref

    model = plugin_config_model(pm)

    def locate(path: KeyPath) -> str | None:
        for end in range(len(path), 0, -1):
            if path[:end] in where:
                return where[path[:end]]
        # A key that only exists because an override created it below (``--set rolout.x=1``).
        return next((text for key, text in where.items() if key[: len(path)] == path), None)

    label = source.display if source.display == ref else repr(source.ref)  # a file as given, or 'name'
    try:
        config = model.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(label, describe_errors(exc, model, locate)) from None
    # Kept for the checks that need the components loaded (their options: miles.config.options).
    remember_origin(config, RecipeOrigin(label, where))
    return config


def component_refs(config: MilesConfig) -> list[tuple[str, str, str]]:
    """``(dotted key, kind, reference)`` for every component the config selects."""
    refs = [
        ("backend", "backend", config.backend),
        ("transport", "transport", config.transport),
        ("rollout.fn", "rollout", config.rollout.fn),
        ("rollout.generate_fn", "generate", config.rollout.generate_fn),
        ("rollout.reward", "reward", config.rollout.reward),
        *((f"rollout.filters[{i}]", "filter", name) for i, name in enumerate(config.rollout.filters)),
        *(
            (f"rollout.reward_postprocess[{i}]", "reward_postprocess", name)
            for i, name in enumerate(config.rollout.reward_postprocess)
        ),
        ("rollout.buffer", "buffer", config.rollout.buffer),
        ("algorithm.advantage", "advantage", config.algorithm.advantage),
        ("algorithm.loss", "loss", config.algorithm.loss),
        ("algorithm.correction", "correction", config.algorithm.correction),
        ("algorithm.critic.loss", "loss", config.algorithm.critic.loss if config.algorithm.critic else None),
        ("data.source", "data_source", config.data.source),
        ("engine.launcher", "engine", config.engine.launcher),
    ]
    return [(key, kind, ref) for key, kind, ref in refs if ref is not None]


def validate_components(config: MilesConfig, *, load: bool = False) -> None:
    """Check every component the config names, reporting all problems at once.

    By default nothing is imported: names must be installed (and unique) and import
    paths' modules must exist. ``load=True`` imports each one, which also catches a
    plugin whose module fails to import (this may import torch).
    """
    from miles.plugins import load_component, validate_component_ref

    check = load_component if load else validate_component_ref
    problems = []
    for key, kind, ref in component_refs(config):
        try:
            check(kind, ref)
        except ComponentError as err:
            problems.append(f"{key}: {err}")
    if len(problems) == 1:
        raise ComponentError(problems[0])
    if problems:
        raise ComponentError(
            f"{len(problems)} component problems:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def dump_config(config: BaseModel) -> str:
    """The config as YAML, loadable again with ``load_recipe``."""
    return dump_yaml(config.model_dump(mode="json"))


def config_json_schema(pm: pluggy.PluginManager | None = None) -> dict[str, Any]:
    """The JSON schema of a recipe, plugin sections included, with the installed components' options.

    ``x-miles-component-options`` maps each kind's group to the JSON schema of every installed
    component's options model (``{"miles.losses": {"ppo_clip": {...}}}``); a component
    without a model takes free-form options and is not listed, one that fails to load is
    listed as ``{"x-miles-load-error": "..."}``.
    """
    schema = plugin_config_model(pm).model_json_schema()
    schema["x-miles-component-options"] = installed_options_schemas()
    return schema


def installed_options_schemas() -> dict[str, dict[str, Any]]:
    from miles._plugins.discovery import group_for, names
    from miles.config.options import component_options_schema, option_kinds
    from miles.errors import MilesError

    out: dict[str, dict[str, Any]] = {}
    for kind in option_kinds():
        group = group_for(kind)
        found: dict[str, Any] = {}
        for name in sorted(names(group)):
            try:
                schema = component_options_schema(kind, name)
            except MilesError as err:
                found[name] = {"x-miles-load-error": str(err)}
                continue
            if schema is not None:
                found[name] = schema
        if found:
            out[group] = found
    return out
