"""``miles report RUN_DIR``: PNG curves and one self-contained HTML page of a run (running or finished)."""

from __future__ import annotations

import click

from miles.cli._common import verbose_option


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), help="where to write (default: RUN_DIR/report)")
@verbose_option
def report(run_dir: str, out: str | None) -> None:
    """Plot a run's metrics into PNGs and one HTML page.

    The curves: reward and exact-answer rate, loss, KL / TIS ratio / clip fraction, response
    length, step time by phase, staleness and engine throughput (those the run logged). The
    page embeds them and the run's config. Works on a running run too.
    """
    from miles.tracking.curves import matplotlib_available
    from miles.tracking.report import build_report

    if not matplotlib_available():
        raise click.ClickException("miles report draws with matplotlib: pip install matplotlib")
    try:
        result = build_report(run_dir, out)
    except FileNotFoundError as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"{len(result.images)} plots from {result.steps} steps: {result.page}")
