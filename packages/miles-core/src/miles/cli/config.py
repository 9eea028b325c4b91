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
    help="Also run the pre-flight checks of `miles run`: build every component, read the data, "
    "probe engine ports (may import torch).",
)
@verbose_option
def validate(recipe: str, overrides: tuple[str, ...], check: bool) -> None:
    """Check RECIPE and the components it names; print `ok: RECIPE` or the problems.

    Without --check components are found, and those that take options are imported (not
    built) to check their options against their options models: names must be installed,
    import paths' modules must exist, and every `*_options` key must be one the component
    declares, with a value of its type. With --check the same pre-flight
    that `miles run` runs before it writes or starts anything runs here
    (miles.driver.preflight): plugins check the config, the model is resolved, the data
    source reads its file, every component is built and type-checked (a reward must be
    callable as reward(sample), a loss as loss(inputs), ...), the objective is resolved,
    and a fixed engine.port must be free.
    """
    from miles.config import load_recipe, validate_components
    from miles.config.options import check_component_options

    config = load_recipe(recipe, overrides)
    validate_components(config, load=check)
    if check:
        from miles.driver.preflight import close_components, preflight

        close_components(preflight(config).components)  # checks the options too
    else:
        check_component_options(config)
    click.echo(f"ok: {recipe}")


@config.command()
@click.option("--indent", default=2, show_default=True, help="JSON indentation.")
@verbose_option
def schema(indent: int) -> None:
    """Print the JSON schema of a recipe, including installed plugins' sections and, under
    x-miles-component-options, every installed component's options model."""
    from miles.config import config_json_schema

    click.echo(json.dumps(config_json_schema(), indent=indent))
