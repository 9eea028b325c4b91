"""Hooks that cannot load: the import below fails, as it would for a plugin missing a dependency."""

from __future__ import annotations

import miles_nonexistent_dependency  # noqa: F401  (the point of this fixture)

from miles import hookimpl


@hookimpl
def miles_on_metrics(step: int, metrics: dict[str, float]) -> None:
    pass
