"""``miles plugins``: what is installed, what it provides, and whether it loads."""

from __future__ import annotations

import json

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
@verbose_option
def plugins(check: bool, as_json: bool) -> None:
    """List installed plugins: what they provide and their status.

    One row per distribution: its version, the components and hook plugins it provides,
    and whether they load. Hook modules and components are imported to check them (a few
    seconds: backends import torch); --no-check imports only hook modules.
    MILES_DISABLE_PLUGINS=a,b keeps hook plugins a and b from loading.
    """
    from miles.plugins import list_plugins

    rows = list_plugins(check=check)
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
    Console(soft_wrap=False).print(table)
    broken = sum(not row.ok for row in rows)
    if broken:
        click.echo(f"{broken} of {len(rows)} distributions have problems", err=True)
