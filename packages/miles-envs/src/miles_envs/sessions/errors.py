"""Errors of the session store, typed so that the HTTP layer can map each to one status code.

Every error says what was wrong and what the agent (or the user configuring the run) can do
about it. ``code`` is a short stable identifier the HTTP layer can put in its JSON body.
"""

from __future__ import annotations

from miles.errors import MilesError


class SessionError(MilesError):
    """Base class of everything the session store raises on purpose."""

    code = "session_error"


class MessageError(SessionError):
    """A message of the request is malformed (bad role, bad tool call...): a client bug (HTTP 400)."""

    code = "bad_message"

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message if index is None else f"message {index}: {message}")
        self.index = index


class MatcherError(SessionError):
    """A replay matcher raised or returned something other than a bool: a bug in the matcher (HTTP 500)."""

    code = "matcher_error"


class SessionNotFound(SessionError):
    """No session with that id (never created, or deleted): HTTP 404."""

    code = "session_not_found"


class SessionClosed(SessionError):
    """The session was deleted while a request was generating: its result is not recorded (HTTP 409/410)."""

    code = "session_closed"


class SessionConflict(SessionError):
    """The session refuses this request; nothing was changed (HTTP 409 or 400).

    ``index`` is the position of the first request message that is the problem, when there
    is one; ``code`` says which rule refused it (see the subclasses).
    """

    code = "conflict"

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class HistoryDiverged(SessionConflict):
    """Linear session: the request rewrites history earlier than the most recent turn."""

    code = "history_diverged"


class EmptyTurn(SessionConflict):
    """The request adds no message after the stored history it matches, so there is nothing to answer."""

    code = "empty_turn"


class TruncatedBranch(SessionConflict):
    """The request extends a checkpoint whose generation stopped at the length limit."""

    code = "truncated"


class AbortedBranch(SessionConflict):
    """The request extends a checkpoint whose generation the engine aborted (retry that turn instead)."""

    code = "aborted"


class SessionBusy(SessionConflict):
    """Linear session: another request of this session is generating; requests are not queued."""

    code = "busy"


class SessionFull(SessionConflict):
    """The session holds its maximum number of checkpoints."""

    code = "full"


class StalePlan(SessionConflict):
    """A plan was committed or abandoned twice, or belongs to another session: a caller bug."""

    code = "stale_plan"
