"""``miles models``: list the built-in models and build them into the cache."""

from __future__ import annotations

import time

import click


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


@click.group(name="models")
def models() -> None:
    """Built-in models (usable as model.path: builtin:NAME)."""


@models.command(name="list")
def list_models() -> None:
    """Show each built-in model, its size, and where it is cached (or "not built")."""
    from miles.models.registry import builtin_models, builtin_path, count_parameters

    rows = [("NAME", "KIND", "PARAMS", "PATH")]
    for spec in builtin_models().values():
        path = builtin_path(spec.name)
        if path.is_dir():
            count = count_parameters(path)
            rows.append((spec.name, spec.kind, _human(count) if count else spec.params, str(path)))
        else:
            rows.append((spec.name, spec.kind, f"~{spec.params}", "not built"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[3])


@models.command(name="build")
@click.argument("name")
@click.option("--force", is_flag=True, help="rebuild even if the model is already cached")
def build(name: str, force: bool) -> None:
    """Build the built-in model NAME into the cache (deterministic; atomic)."""
    from miles.models.registry import build_model, builtin_path, is_built

    builtin_path(name)  # an unknown name fails here, before anything is built
    if is_built(name) and not force:
        click.echo(f"{name} is already built at {builtin_path(name)} (use --force to rebuild)")
        return
    start = time.perf_counter()
    path = build_model(name, force=force)
    click.echo(f"built {name} at {path} in {time.perf_counter() - start:.1f}s")
