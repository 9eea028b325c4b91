"""What every engine process a launcher starts does before it serves: claim its port, and end with
the process that started it.

The engine kinds' servers (the embedded engine, a plugin's, such as the diffusion engine) call
these from their ``main`` so a port clash and an orphaned engine are handled one way everywhere.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import threading
import time

log = logging.getLogger("miles.engines")


def listen(host: str, port: int, who: str, backlog: int = 2048) -> socket.socket:
    """A socket listening on ``host:port``, claimed before the (slow) model load so a clash fails
    at once; ``who`` names the engine in the one-line error a taken or unusable address gives."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(
                f"{who}: port {port} on {host} is already in use; "
                "pick another port (or leave it unset to get a free one)"
            ) from None
        raise SystemExit(f"{who}: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(backlog)
    # Accepted connections inherit TCP_NODELAY from the listening socket. Without it Nagle's
    # algorithm holds a response's last small segment until the client's delayed ACK, and every
    # request after the first on a kept-alive connection took at least 40 ms (uvicorn, handed a
    # ready socket, does not set it; it does when it binds the port itself).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def exit_with_parent(pid: int) -> None:
    """Stop this process (SIGTERM to itself) once process ``pid``, which started it, is gone: an
    engine whose driver was killed must not outlive it holding a port and device memory."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != pid:
                log.warning("parent process %d is gone; shutting down", pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="miles-parent-watch", daemon=True).start()
