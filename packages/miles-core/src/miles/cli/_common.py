"""Options and output shared by the commands (light: click and logging only)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

_VERBOSE_KEY = "miles.verbose"


def _set_verbose(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta[_VERBOSE_KEY] = True
        configure_logging()
    return value


def verbose_option(f: F) -> F:
    """``-v/--verbose``, accepted before or after the subcommand (``miles -v run`` or ``miles run -v``)."""
    return click.option(
        "-v",
        "--verbose",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_set_verbose,
        help="Show tracebacks and debug logs.",
    )(f)


def is_verbose(ctx: click.Context | None = None) -> bool:
    ctx = ctx or click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(_VERBOSE_KEY))


def set_option(f: F) -> F:
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a recipe key (YAML value), e.g. --set rollout.temperature=0.7 --set rollout.filters=[]. Repeatable.",
    )(f)


def recipe_argument(f: F) -> F:
    return click.argument("recipe", default="default", metavar="[RECIPE]")(f)


class _ClickHandler(logging.Handler):
    """Writes through click so output follows whatever stderr is current (and CliRunner captures it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(self.format(record), err=True)
        except Exception:  # logging must never take the command down
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info and record.levelno <= logging.DEBUG:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging() -> None:
    """One handler on the ``miles`` logger: INFO and up, or DEBUG (with tracebacks) when verbose."""
    logger = logging.getLogger("miles")
    handler = next((h for h in logger.handlers if isinstance(h, _ClickHandler)), None)
    if handler is None:
        handler = _ClickHandler()
        handler.setFormatter(_Formatter())
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if is_verbose() else logging.INFO)
