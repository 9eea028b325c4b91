"""``miles run``: validate a recipe and its components, then train."""

from __future__ import annotations

import click

from miles.cli._common import recipe_argument, set_option, verbose_option


@click.command()
@recipe_argument
@set_option
@click.option(
    "--resume", is_flag=True, help="Continue the run in the recipe's run directory from its last checkpoint."
)
@click.option(
    "--overwrite", is_flag=True, help="Delete the results of an earlier run in the same run directory first."
)
@click.option("--dry-run", is_flag=True, help="Stop after validation and print the resolved recipe.")
@verbose_option
def run(recipe: str, overrides: tuple[str, ...], resume: bool, overwrite: bool, dry_run: bool) -> None:
    """Train with a recipe (built-in name or YAML file).

    RECIPE is a recipe name (see `miles recipes`; default: default) or a YAML file. The
    recipe, the overrides and every component it names are checked before anything heavy
    starts (engines, trainer processes).
    """
    if resume and overwrite:
        raise click.UsageError(
            "--resume and --overwrite exclude each other: continue the run, or start it afresh"
        )
    from miles.config import dump_config, load_recipe, validate_components

    config = load_recipe(recipe, overrides)
    # Import every selected component now: a broken plugin fails here, not after engines started.
    validate_components(config, load=True)
    if dry_run:
        from miles.driver.preflight import close_components, preflight

        close_components(preflight(config).components)  # refuses exactly what a run would refuse
        click.echo(dump_config(config), nl=False)
        return
    from miles.driver.interrupts import exit_code
    from miles.errors import RunComplete, RunInterrupted
    from miles.loop import train

    _print_evidence(config, overrides)
    again = resume_command(recipe, overrides)
    try:
        result = train(config, resume=resume, overwrite=overwrite)
    except RunComplete as done:
        _console().print(f"[bold green]done[/]: {done}")
        return
    except RunInterrupted as stopped:
        hint = f"; continue with: {again}" if stopped.checkpoint else ""
        _console().print(f"[bold yellow]interrupted[/]: {stopped}{hint}")
        raise click.exceptions.Exit(exit_code(stopped.signum)) from None
    except KeyboardInterrupt as exc:  # a second signal (or one during start-up): stopped at once
        import signal

        signum = getattr(exc, "signum", signal.SIGINT)
        _console().print(
            f"[bold yellow]interrupted[/]: stopped at once by {signal.Signals(signum).name}; every process "
            f"the run started was stopped. Continue from its last checkpoint with: {again}"
        )
        raise click.exceptions.Exit(exit_code(signum)) from None
    _print_summary(result)


def resume_command(recipe: str, overrides: tuple[str, ...]) -> str:
    """The command line that continues this run (same recipe and overrides, plus ``--resume``)."""
    import shlex

    return shlex.join(["miles", "run", recipe, *(a for o in overrides for a in ("--set", o)), "--resume"])


def _print_evidence(config, overrides: tuple[str, ...]) -> None:
    """The recipe's evidence level, when it declares one (and whether overrides leave it as shipped)."""
    evidence = config.evidence
    if evidence is None:
        return
    from rich.markup import escape

    name = escape(config.recipe or "recipe")
    detail = f" ({escape(evidence.detail)})" if evidence.detail else ""
    line = f"recipe {name}: evidence level [bold]{evidence.level}[/]{detail}"
    if overrides:
        line += "; overridden with --set, so the level describes the recipe as shipped, not this run"
    _console().print(line)


def _console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)  # one line each, however narrow the terminal


def _print_summary(result) -> None:
    import os

    console = _console()
    console.print(f"[bold green]done[/]: {result.steps_done} steps in {result.seconds:.0f} s")
    console.print(f"  run directory   {result.run_dir}")
    console.print(f"  metrics         {result.metrics_path}")
    tb = os.path.join(result.run_dir, "tensorboard")
    if os.path.isdir(tb):
        console.print(f"  tensorboard     {tb}")
    if result.checkpoint:
        console.print(f"  checkpoint      {result.checkpoint}  (miles run ... --resume)")
    if result.final_dir:
        console.print(f"  final HF model  {result.final_dir}")
