"""The ``miles`` command line.

The root group imports nothing but click: each subcommand lives in its own module,
imported only when that subcommand runs (its one-line help is kept here so that
``miles --help`` imports none of them). Errors a user can fix (``MilesError``) print
as one ``Error: ...`` line and exit 1; ``-v`` shows the traceback instead.

Plugins add commands through the ``miles.commands`` entry-point group
(``name = "pkg.module:click_command"``; miles-envs's ``serve`` and ``check-family`` are two),
found from metadata only. A plugin's command is imported when it runs or when ``miles --help``
asks for its help line (keep its module light), and one that fails to import is listed as
broken instead of stopping ``miles``; a plugin cannot replace a built-in command.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from miles.cli._common import configure_logging, is_verbose, verbose_option

# name -> ("module:attribute", one-line help). Add a command here and in its own module.
# Plugins' commands come from the COMMANDS_GROUP entry points (``plugin_commands``).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("miles.cli.run:run", "Train with a recipe (built-in name or YAML file)."),
    "config": ("miles.cli.config:config", "Show, validate or describe a recipe's configuration."),
    "plugins": ("miles.cli.plugins:plugins", "List installed plugins: what they provide and their status."),
    "recipes": ("miles.cli.recipes:recipes", "List the recipes that can be run by name."),
    "models": ("miles.cli.models:models", "Built-in models (usable as model.path: builtin:NAME)."),
    "report": ("miles.cli.report:report", "Plot a run's metrics into PNGs and one HTML page."),
    "replay": ("miles.cli.replay:replay", "Replay a rollout dump: re-score it, or compare its log-probs."),
    "engine": ("miles.cli.engine:engine", "Talk to a running engine: one raw /generate request."),
}


COMMANDS_GROUP = "miles.commands"


def plugin_commands() -> dict[str, str]:
    """``{name: "module:attribute"}`` of the commands installed plugins declare (metadata only).

    A plugin cannot replace a built-in command: a name that is already one is left out.
    """
    from importlib.metadata import entry_points

    found: dict[str, str] = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        if ep.name not in LAZY_COMMANDS:
            found.setdefault(ep.name, ep.value)
    return found


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def __init__(
        self, *args: Any, lazy_commands: dict[str, tuple[str, str]] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands, *self._plugin_commands()})

    def _plugin_commands(self) -> dict[str, str]:
        return {}

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            if cmd_name in self.lazy_commands:
                self.add_command(self._import(cmd_name, self.lazy_commands[cmd_name][0]), cmd_name)
            elif cmd_name in (plugins := self._plugin_commands()):
                self.add_command(self._import(cmd_name, plugins[cmd_name]), cmd_name)
        return super().get_command(ctx, cmd_name)

    def _import(self, cmd_name: str, target: str) -> click.Command:
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            raise click.ClickException(f"the {cmd_name!r} command is not available: {err}") from err
        command = getattr(module, attr, None)
        if not isinstance(command, click.Command):
            raise click.ClickException(f"{target} is not a click command")
        return command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = click.utils.make_str(args[0]) if args else ""
        if args and not name.startswith("-") and self.get_command(ctx, name) is None:
            import difflib

            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            ctx.fail(f"No such command {name!r}.{hint} Commands: {', '.join(self.list_commands(ctx))}.")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in self.list_commands(ctx))
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy_commands and name not in self.commands:
                rows.append((name, self.lazy_commands[name][1]))
            elif name not in self.commands and name in self._plugin_commands():
                try:
                    command = self.get_command(ctx, name)
                except Exception as err:  # a broken plugin is listed, never stops miles --help
                    rows.append((name, f"(broken plugin command: {err})"))
                    continue
                if command is not None and not command.hidden:
                    rows.append((name, command.get_short_help_str(limit)))
            else:
                command = super().get_command(ctx, name)
                if command is not None and not command.hidden:
                    rows.append((name, command.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class MilesGroup(LazyGroup):
    """Turns ``MilesError`` into click's one-line ``Error: ...`` (unless ``-v``), and so does a
    missing optional library (torch, transformers, ...), with the extra that installs it.
    It also offers the commands plugins declare (``miles.commands``)."""

    def _plugin_commands(self) -> dict[str, str]:
        return plugin_commands()

    def invoke(self, ctx: click.Context) -> Any:
        from miles.errors import MilesError

        try:
            return super().invoke(ctx)
        except MilesError as err:
            if is_verbose(ctx):
                raise
            raise click.ClickException(str(err)) from err
        except ImportError as err:
            from miles._plugins.hints import missing_library

            message = missing_library(err)
            if message is None or is_verbose(ctx):  # an unknown module is a bug: keep its traceback
                raise
            raise click.ClickException(f"{message} (-v shows where it was imported)") from err


@click.group(
    cls=MilesGroup, lazy_commands=LAZY_COMMANDS, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(package_name="miles-core", prog_name="miles")
@verbose_option
def cli() -> None:
    """Miles: RL post-training for language models.

    \b
    Quick start:
      miles run                      # the built-in default recipe
      miles run my.yaml --set rollout.temperature=0.7
      miles config show default      # the resolved recipe
      miles plugins                  # what is installed
    """
    configure_logging()


def main() -> None:
    """Entry point of the ``miles`` console script."""
    cli(prog_name="miles")
