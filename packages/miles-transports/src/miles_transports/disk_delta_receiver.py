"""Engine side of the disk-delta transport: ``/update_weights_from_disk_delta`` (a Miles extension).

Registered as the ``disk-delta`` receiver (entry-point group ``miles.engine_receivers``, see
:mod:`miles.engines.embedded.receivers`); its launch option ``delta_root`` (``--delta-root``)
is the only directory the engine reads deltas from, so a request names a version number,
never a path. The trainer side is :class:`miles_transports.disk_delta.DiskDeltaTransport`.

``POST /update_weights_from_disk_delta {version, weight_version?}`` reads
``DELTA_ROOT/v{version:06d}``, the delta from the engine's current (integer) weight version,
verifies every file and the digest of every resulting tensor with
:func:`miles_transports.weight_delta.read_delta` while generation goes on, and then commits the
changed tensors through the engine's :class:`~miles.engines.embedded.weights.WeightUpdater`
(between two scheduler steps) and sets the version (``weight_version``, default
``str(version)``). Any problem is a 400 and leaves the model and version as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from miles.engines.embedded.receivers import EngineReceiver, ReceiverOption, ok, run_update

if TYPE_CHECKING:
    import torch
    from fastapi import FastAPI

    from miles.engines.embedded.engine import EmbeddedEngine
    from miles.engines.embedded.weights import WeightUpdater


class UpdateFromDiskDeltaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(
        ...,
        ge=0,
        strict=True,
        description="the delta version to apply: the engine reads DELTA_ROOT/v{version:06d}, DELTA_ROOT being "
        "its --delta-root (a request cannot name a path)",
    )
    weight_version: str | None = Field(
        None, description="the engine's version afterwards (default: str(version))"
    )


def read_verified_delta(
    weights: WeightUpdater, delta_root: Path | None, version: int
) -> dict[str, torch.Tensor]:
    """The tensors delta ``version`` changes, verified against the model as it is served.

    Called by ``WeightUpdater.update`` under its lock, so the engine's version (the delta's
    base) cannot change between this check and the commit.
    """
    from miles.engines.embedded.weights import WeightUpdateError
    from miles_transports.weight_delta import DeltaError, read_delta

    if delta_root is None:
        raise WeightUpdateError(
            "this engine was started without --delta-root, so it applies no disk deltas; start it with "
            "--delta-root DIR (engine option delta_root) naming the directory the trainer publishes to"
        )
    where = f"delta v{version:06d} under {str(delta_root)!r}"
    current = weights.version
    try:
        base = int(current)
    except ValueError:
        raise WeightUpdateError(
            f"{where}: the engine's weight version {current!r} is not an integer, so it names no delta "
            "base; give the engine an integer version (--weight-version, or a weight update's "
            "weight_version)"
        ) from None
    try:
        new = read_delta(delta_root, version, weights.cpu_tensors(), base)
    except DeltaError as exc:
        raise WeightUpdateError(f"{where} refused: {exc}") from exc
    # read_delta verified the bytes; this verifies they fit the model as it is served.
    try:
        weights.check(((n, t.shape, t.dtype) for n, t in new.items()), exact_dtype=True)
    except WeightUpdateError as exc:
        raise WeightUpdateError(f"{where} refused: {exc}") from exc
    return new


def mount(app: FastAPI, engine: EmbeddedEngine, options: Mapping[str, str | None]) -> None:
    """Add ``/update_weights_from_disk_delta`` to the engine's app."""
    root = options.get("delta_root")
    delta_root = Path(root).resolve() if root else None
    router = APIRouter(tags=["disk-delta weight updates"])

    @router.post(
        "/update_weights_from_disk_delta",
        summary="Miles extension: apply disk-delta version N from the engine's --delta-root (verified first)",
        description="Reads DELTA_ROOT/v{version:06d}, the delta from the engine's current (integer) weight "
        "version, verifies every file and the digest of every resulting tensor while generation goes on, then "
        "swaps the changed tensors in between two scheduler steps and sets the version (weight_version, default "
        "str(version)). Any problem is a 400 and leaves the model and version as they were.",
    )
    async def update_weights_from_disk_delta(body: UpdateFromDiskDeltaBody) -> Any:
        version = body.weight_version if body.weight_version is not None else str(body.version)

        def work() -> dict[str, Any]:
            n = engine.weights.update(
                lambda: read_verified_delta(engine.weights, delta_root, body.version), version
            )
            return ok(
                f"Applied delta v{body.version:06d}: {n} tensors changed. Weight version updated to {version}."
            )

        return await run_update("weights not updated", work)

    app.include_router(router)


RECEIVER = EngineReceiver(
    name="disk-delta",
    mount=mount,
    options=(
        ReceiverOption(
            "delta_root",
            "directory of disk-delta versions (v000001/, ...) for /update_weights_from_disk_delta",
        ),
    ),
)
