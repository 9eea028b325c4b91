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

    # Bind here and hand uvicorn the socket: a port chosen by the OS (``port=0``) stays ours from
    # this moment, instead of being released and re-bound, which another process can win.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"the session server cannot bind {host}:{port}: {exc.strerror}") from exc
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="miles-session-server", daemon=True
    )
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
        sock.close()
