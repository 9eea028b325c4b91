"""``miles recipes``: the recipes that can be run by name."""

from __future__ import annotations

import click

from miles.cli._common import verbose_option


@click.command()
@verbose_option
def recipes() -> None:
    """List the recipes that can be run by name.

    Built-in recipes, those installed plugins ship (the miles.recipes entry points), and the
    NAME.yaml files in the directories on MILES_RECIPE_PATH.
    """
    from rich.console import Console
    from rich.table import Table

    from miles.config import list_recipes

    table = Table(box=None, pad_edge=False)
    table.add_column("Recipe", no_wrap=True)
    table.add_column("Description", overflow="fold")
    table.add_column("From", overflow="fold")
    for info in list_recipes():
        table.add_row(info.name, info.description, info.location)
    Console(soft_wrap=False).print(table)
