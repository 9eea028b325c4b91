"""The session server as a run uses it: started once, sessions opened and closed per episode.

The driver starts the server (``session_service``) when ``rollout.generate_fn`` is
``agentic``; the agentic generate function opens a session for each episode, hands its
base URL to the agent function, then closes it and reads its trajectory. Opening and closing
are direct calls on the in-process store (they need no HTTP); the agent's turns go over HTTP
like any external agent's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from miles_envs.session_server.app import ServerState, SessionUsage
from miles_envs.sessions import Session


@dataclass
class ClosedSession:
    """A finished episode's session and what its turns cost (tokens; whether it ran out of them)."""

    session: Session
    usage: SessionUsage


@dataclass
class SessionService:
    """A running session server: its URL and its state (store, family, engines)."""

    url: str
    state: ServerState

    def open(self) -> tuple[str, str]:
        """Create a session pinned to an engine; returns its id and the agent's base URL (``.../v1``)."""
        session = self.state.store.create()
        self.state.place(session.id)
        return session.id, f"{self.url}/sessions/{session.id}/v1"

    def close(self, session_id: str) -> ClosedSession:
        """Delete the session (later requests to it fail) and return it, to read its trajectory."""
        try:
            session = self.state.store.delete(session_id)
        finally:
            usage = self.state.release(session_id)
        return ClosedSession(session=session, usage=usage)


@contextlib.contextmanager
def session_service(state: ServerState, host: str = "127.0.0.1", port: int = 0) -> Iterator[SessionService]:
    """Serve ``state`` in a background thread for the duration of the block."""
    from miles_envs.session_server.serve import serve

    with serve(state, host=host, port=port) as url:
        yield SessionService(url=url, state=state)
