"""Engine side of the CUDA-IPC transport: ``/update_weights_from_cuda_ipc`` (a Miles extension).

Registered as the ``cuda-ipc`` receiver (entry-point group ``miles.engine_receivers``, see
:mod:`miles.engines.embedded.receivers`). A request carries one bucket: the IPC handle of a flat
device buffer the trainer filled, and where each named tensor sits in it
(:class:`miles_transports.cuda_ipc.IpcBucket`). The engine maps the buffer (refusing a buffer on
another GPU), checks every name, shape and dtype against its model, copies the tensors out and
unmaps the buffer before it answers, so the trainer may free it as soon as the answer comes. A
bucket without ``weight_version`` is staged; the last one commits the update between two scheduler
steps (and empties the prefix cache), like every other transport's (:class:`~miles.engines.embedded.weights.WeightUpdater`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

from miles.engines.embedded.receivers import EngineReceiver, ok, run_update
from miles_transports.cuda_ipc import IPC_ROUTE, IpcBucket

if TYPE_CHECKING:
    import torch
    from fastapi import FastAPI

    from miles.engines.embedded.engine import EmbeddedEngine


def read_bucket(engine: EmbeddedEngine, body: IpcBucket) -> dict[str, torch.Tensor]:
    """The bucket's tensors as engine-owned copies (the mapping is closed when this returns)."""
    from miles.engines.embedded.weights import WeightUpdateError
    from miles_transports.cuda_ipc import open_buffer, views

    try:
        buffer = open_buffer(body.buffer, engine.device)
        mapped = views(buffer, body.tensors)
    except ValueError as exc:
        raise WeightUpdateError(str(exc)) from exc
    try:
        engine.weights.check((name, t.shape, t.dtype) for name, t in mapped.items())
        targets = engine.weights.targets
        # Copies in the engine's dtype; the staged update keeps these after the buffer is gone.
        return {name: t.to(dtype=targets[name].dtype, copy=True) for name, t in mapped.items()}
    finally:
        del mapped, buffer


def mount(app: FastAPI, engine: EmbeddedEngine, options: Mapping[str, str | None]) -> None:
    router = APIRouter(tags=["CUDA-IPC weight updates"])

    @router.post(
        IPC_ROUTE,
        summary="Miles extension: take one bucket of weights from a CUDA IPC handle on this engine's GPU",
        description="The body names a flat device buffer (its IPC handle, as plain fields) and where each "
        "tensor lies in it. The engine copies the tensors out and unmaps the buffer before answering; the "
        "bucket with weight_version commits the update between two scheduler steps. A buffer on another GPU, "
        "an unknown name or a wrong shape is a 400 and changes nothing.",
    )
    async def update_weights_from_cuda_ipc(body: IpcBucket) -> Any:
        def work() -> dict[str, Any]:
            outcome = engine.weights.update_bucket(
                lambda: read_bucket(engine, body),
                weight_version=body.weight_version,
                bucket_index=body.bucket_index,
            )
            note = f" Weight version updated to {body.weight_version}." if outcome.committed else ""
            return ok(outcome.message + note, committed=outcome.committed)

        return await run_update("weights not updated", work)

    app.include_router(router)


RECEIVER = EngineReceiver(name="cuda-ipc", mount=mount)
