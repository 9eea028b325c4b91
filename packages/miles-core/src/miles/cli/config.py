"""``miles config``: show, validate and describe recipes without running them."""

from __future__ import annotations

import json

import click

from miles.cli._common import recipe_argument, set_option, verbose_option


@click.group()
def config() -> None:
    """Show, validate or describe a recipe's configuration."""


@config.command()
@recipe_argument
@set_option
@verbose_option
def show(recipe: str, overrides: tuple[str, ...]) -> None:
    """Print RECIPE (name or YAML file) fully resolved: defaults, overrides and plugin sections filled in."""
    from miles.config import dump_config, load_recipe

    click.echo(dump_config(load_recipe(recipe, overrides)), nl=False)


@config.command()
@recipe_argument
@set_option
@click.option(
    "--check",
    is_flag=True,
    help="Also import every selected component and resolve the objective (may import torch).",
)
@verbose_option
def validate(recipe: str, overrides: tuple[str, ...], check: bool) -> None:
    """Check RECIPE and the components it names; print `ok: RECIPE` or the problems.

    Without --check components are found without being imported: names must be
    installed and import paths' modules must exist. With --check the objective is
    resolved too (the loss an unset algorithm.loss means, the critic, reference and
    teacher models and their tokenizers), as `miles run` does before starting anything.
    """
    from miles.config import load_recipe, validate_components

    config = load_recipe(recipe, overrides)
    validate_components(config, load=check)
    if check:
        from miles.driver.objective import resolve_objective
        from miles.models.registry import resolve_model

        resolve_objective(config, resolve_model(config.model.path))
    click.echo(f"ok: {recipe}")


@config.command()
@click.option("--indent", default=2, show_default=True, help="JSON indentation.")
@verbose_option
def schema(indent: int) -> None:
    """Print the JSON schema of a recipe, including installed plugins' sections."""
    from miles.config import config_json_schema

    click.echo(json.dumps(config_json_schema(), indent=indent))
