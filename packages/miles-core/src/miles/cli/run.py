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
        from miles.driver.objective import resolve_objective
        from miles.models.registry import resolve_model

        resolve_objective(config, resolve_model(config.model.path))
        click.echo(dump_config(config), nl=False)
        return
    from miles.loop import train

    result = train(config, resume=resume, overwrite=overwrite)
    _print_summary(result)


def _print_summary(result) -> None:
    import os

    from rich.console import Console

    console = Console(stderr=True)
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
