"""HTTP routes of peer-to-peer weight updates (a Miles extension; SGLang has no such endpoints).

Registered as the ``p2p`` engine receiver (entry-point group ``miles.engine_receivers``,
see :mod:`miles.engines.embedded.receivers`): the embedded engine mounts :data:`RECEIVER`,
which adds ``p2p_router(engine)`` to its app. The sequence a sender follows, per engine (see ``miles_transports.p2p``):

1. ``POST /p2p/init {bucket_bytes, protocol?, hostname?, device_name?}`` ->
   ``{success, message, session, buffer_ptr, buffer_len, protocol}``: the engine's
   Mooncake session (``host:port``) and the address range the sender may write.
   ``hostname`` defaults to the host the request was addressed to, which is an
   address the sender can reach. Calling it again with another ``bucket_bytes``
   replaces the buffer (same session).
2. Per bucket: write the packed bytes into ``[buffer_ptr, buffer_ptr + buffer_len)``
   with Mooncake, then ``POST /p2p/apply {session, names, dtypes, shapes, offsets,
   weight_version?, bucket_index?}``. It answers once the bucket is copied out of the
   buffer, so the sender may then overwrite it. Without ``weight_version`` the bucket is
   staged (``committed: false``); with it, every staged bucket and this one are
   committed together and the version is set (``committed: true``).
3. ``POST /p2p/close {}``: drop the receiver and its buffer.

Errors are ``{"success": false, "message"}`` with HTTP 400, as for the other weight
endpoints; an unexpected failure is a 500. A refused bucket discards the update's
staged buckets (the model is unchanged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from miles.engines.embedded.receivers import EngineReceiver
from miles.engines.embedded.weights import WeightUpdateError
from miles_transports.p2p.receiver import P2PService

log = logging.getLogger("miles_transports.p2p")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class P2PInitBody(_Body):
    bucket_bytes: int = Field(
        ..., ge=1, description="size of the receive buffer; a bucket's packed bytes fit in it"
    )
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="Mooncake transport: tcp anywhere, rdma on RDMA NICs"
    )
    hostname: str | None = Field(
        None, min_length=1, description="address senders reach this engine at (default: the request's host)"
    )
    device_name: str = Field("", description="Mooncake device filter, e.g. an RDMA NIC 'mlx5_0' ('' = all)")


class P2PApplyBody(_Body):
    session: str = Field(
        ..., description="the session /p2p/init returned; guards against a re-created receiver"
    )
    names: list[str]
    dtypes: list[str] = Field(..., description="per tensor, e.g. 'bfloat16' (a 'torch.' prefix is accepted)")
    shapes: list[list[int]]
    offsets: list[int] = Field(..., description="per tensor, its first byte in the receive buffer")
    weight_version: str | None = Field(
        None,
        description="on the update's last bucket only: commits all staged buckets, then sets the version",
    )
    bucket_index: int | None = Field(None, ge=0, description="this bucket's position in its update (0 first)")


def _ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def _fail(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=code)


async def _run(what: str, work: Callable[[], dict[str, Any]]) -> Any:
    """Run blocking ``work`` off the event loop; a refusal is a 400, anything else a 500."""
    try:
        return await asyncio.to_thread(work)
    except WeightUpdateError as exc:  # P2PError included
        return _fail(f"{what}: {exc}")
    except Exception as exc:
        log.exception("%s failed", what)
        return _fail(f"{what}: {type(exc).__name__}: {exc}", code=500)


def p2p_router(engine: Any) -> APIRouter:
    """Routes for a started :class:`~miles.engines.embedded.engine.EmbeddedEngine` (uses ``weights``, ``device``)."""
    service = P2PService(engine.weights, engine.device)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(service.close)

    router = APIRouter(prefix="/p2p", tags=["p2p weight updates"], lifespan=lifespan)

    @router.post("/init", summary="Create (or resize) this engine's P2P receive buffer; returns its session")
    async def p2p_init(body: P2PInitBody, request: Request) -> Any:
        hostname = body.hostname or request.url.hostname or "127.0.0.1"

        def work() -> dict[str, Any]:
            info = service.init(
                bucket_bytes=body.bucket_bytes,
                protocol=body.protocol,
                hostname=hostname,
                device_name=body.device_name,
            )
            return _ok(f"P2P receiver ready on {info['session']} ({info['buffer_len']} bytes).", **info)

        return await _run("p2p init", work)

    @router.post(
        "/apply", summary="Take the bucket just written into the receive buffer (staged until the last)"
    )
    async def p2p_apply(body: P2PApplyBody) -> Any:
        def work() -> dict[str, Any]:
            outcome = service.apply(
                session=body.session,
                names=body.names,
                dtypes=body.dtypes,
                shapes=body.shapes,
                offsets=body.offsets,
                weight_version=body.weight_version,
                bucket_index=body.bucket_index,
            )
            note = f" Weight version updated to {body.weight_version}." if outcome.committed else ""
            return _ok(outcome.message + note, committed=outcome.committed, num_paused_requests=0)

        return await _run("weights not updated", work)

    @router.post("/close", summary="Drop this engine's P2P receiver and its buffer")
    async def p2p_close() -> Any:
        def work() -> dict[str, Any]:
            closed = service.close()
            return _ok("P2P receiver closed." if closed else "No P2P receiver was open.")

        return await _run("p2p close", work)

    return router


def mount(app: FastAPI, engine: Any, options: Mapping[str, str | None]) -> None:
    """Add ``/p2p/init``, ``/p2p/apply`` and ``/p2p/close``; Mooncake is imported only by ``/p2p/init``."""
    app.include_router(p2p_router(engine))


RECEIVER = EngineReceiver(name="p2p", mount=mount)
