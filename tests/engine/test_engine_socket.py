"""The socket an engine process serves on (``miles.engines.process.listen``)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import time

import pytest

from miles.engines.process import listen


def test_connections_to_an_engine_socket_send_without_nagle_delay():
    """Accepted connections have TCP_NODELAY (inherited from the listening socket): without it a
    response's last segment waited for the client's delayed ACK, 40 ms a request."""
    server = listen("127.0.0.1", 0, "test engine")
    try:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
        try:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            accepted.close()
            client.close()
    finally:
        server.close()


def _serve(sock: socket.socket) -> None:
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, bool]:
        return {"ok": True}

    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


async def _round_trips(port: int, n: int) -> list[float]:
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as client:
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.get("/ping")
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            (await client.get("/ping")).raise_for_status()
            out.append(time.perf_counter() - t0)
        return out


@pytest.mark.slow
def test_kept_alive_requests_to_uvicorn_on_the_engine_socket_take_no_40ms_floor():
    """The same through uvicorn, as the engines serve: kept-alive requests answer in far less than
    the 40 ms delayed-ACK floor they all took before (median of 15; the floor was 44 ms here)."""
    sock = listen("127.0.0.1", 0, "test engine")
    port = sock.getsockname()[1]
    server = mp.get_context("spawn").Process(target=_serve, args=(sock,), daemon=True)
    server.start()
    try:
        times = sorted(asyncio.run(_round_trips(port, 15)))
    finally:
        server.terminate()
        server.join(10)
        sock.close()
    assert times[len(times) // 2] < 0.03, times
