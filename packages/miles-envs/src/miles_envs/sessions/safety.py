"""Run-level rules for runs that use sessions, checked before any heavy work starts."""

from __future__ import annotations

from miles.errors import ConfigError

# In-flight update modes that keep a request's tokens: its generation resumes after the update.
SESSION_UPDATE_MODES = ("retract", "in_place")


def check_update_mode(update_mode: str) -> None:
    """Refuse ``fully_async.update_mode`` values a session cannot survive.

    ``abort`` answers in-flight requests as aborted when weights change: an agent's turn would
    end early with a cut-off reply, and the session's token history would be torn down in the
    middle of a trajectory. ``retract`` and ``in_place`` finish every request, so they are safe.
    """
    if update_mode in SESSION_UPDATE_MODES:
        return
    allowed = " or ".join(repr(m) for m in SESSION_UPDATE_MODES)
    if update_mode == "abort":
        raise ConfigError(
            "fully_async.update_mode 'abort' cannot be used with sessions (the session server): aborting "
            "in-flight requests at a weight update tears a session's token history down in the middle of a "
            f"trajectory. Set fully_async.update_mode to {allowed} (retract is the default)"
        )
    raise ConfigError(f"unknown fully_async.update_mode {update_mode!r}; with sessions use {allowed}")
