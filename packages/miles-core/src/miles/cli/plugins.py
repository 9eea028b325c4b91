"""``miles plugins``: what is installed, what it provides, and whether it loads."""

from __future__ import annotations

import json
from typing import Any

import click

from miles.cli._common import verbose_option


@click.command()
@click.option(
    "--check/--no-check",
    default=True,
    show_default=True,
    help="Import every component (backends, losses, ...) and report those that fail; "
    "--no-check is faster (no torch) and marks them 'components not checked'.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--details",
    is_flag=True,
    help="Also list each component's options (name, type, default, description), from its options model.",
)
@verbose_option
def plugins(check: bool, as_json: bool, details: bool) -> None:
    """List installed plugins: what they provide and their status.

    One row per distribution: its version, the components and hook plugins it provides,
    and whether they load. Hook modules and components are imported to check them (a few
    seconds: backends import torch); --no-check imports only hook modules.
    MILES_DISABLE_PLUGINS=a,b keeps hook plugins a and b from loading. --details lists the
    options of every component that declares an options model (the keys its `*_options`
    mapping in a recipe may set); a component without one takes free-form options.
    """
    from miles.plugins import list_plugins

    rows = list_plugins(check=check, details=details)
    if as_json:
        click.echo(json.dumps([row.to_dict() for row in rows], indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    table.add_column("Distribution", no_wrap=True)
    table.add_column("Version", no_wrap=True)
    table.add_column("Provides", overflow="fold")
    table.add_column("Status", overflow="fold")  # never cut the error: it is the point of the listing
    for row in rows:
        color = "red" if not row.ok else "green" if row.status == "active" else "yellow"
        # Escaped: an error may hold brackets (``pip install 'miles-core[fsdp]'``) that rich would eat.
        status = f"[{color}]{escape(row.status)}[/]"
        table.add_row(row.distribution, row.version, escape("\n".join(row.provides)), status)
    console = Console(soft_wrap=False)
    console.print(table)
    if details:
        _print_options(console, rows)
    broken = sum(not row.ok for row in rows)
    if broken:
        click.echo(f"{broken} of {len(rows)} distributions have problems", err=True)


def _print_options(console: Any, rows: list[Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    for row in rows:
        for component, fields in row.options.items():
            console.print(f"\n[bold]{escape(component)}[/] ({escape(row.distribution)}) options:")
            if not fields:
                console.print("  (none: every key is refused)")
                continue
            table = Table(box=None, pad_edge=False, show_header=True)
            for column in ("Option", "Type", "Default", "Description"):
                table.add_column(column, overflow="fold")
            for f in fields:
                table.add_row(
                    "  " + escape(f["name"]),
                    escape(f["type"]),
                    escape(f["default"]),
                    escape(f["description"]),
                )
            console.print(table)
