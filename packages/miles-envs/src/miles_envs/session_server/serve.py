"""Run the session server in a background thread of this process (127.0.0.1 by default)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from miles_envs.session_server.app import ServerState, create_app


@contextlib.contextmanager
def serve(
    state: ServerState, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0
) -> Iterator[str]:
    """Serve ``state`` with uvicorn until the block ends; yields the base URL.

    The server's event loop is its own thread's: the engine clients in ``state`` open their
    HTTP sessions on it (lazily, on first use) and the app closes them when it stops.
    """
    import uvicorn

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="miles-session-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the session server did not start on {host}:{port}")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
