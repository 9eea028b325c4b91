"""Recipes: typed sections (``schema``), plugin sections, YAML files, ``--set`` overrides, validation."""

from miles.config.loader import (
    RecipeError,
    component_refs,
    config_json_schema,
    config_model,
    dump_config,
    load_recipe,
    plugin_config_model,
    validate_components,
)
from miles.config.recipes import RECIPE_PATH_ENV, RecipeInfo, find_recipe, list_recipes
from miles.config.schema import MilesConfig
from miles.config.sections import ConfigSection

__all__ = [
    "RECIPE_PATH_ENV",
    "ConfigSection",
    "MilesConfig",
    "RecipeError",
    "RecipeInfo",
    "component_refs",
    "config_json_schema",
    "config_model",
    "dump_config",
    "find_recipe",
    "list_recipes",
    "load_recipe",
    "plugin_config_model",
    "validate_components",
]
