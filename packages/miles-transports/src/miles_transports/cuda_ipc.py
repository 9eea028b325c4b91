"""CUDA-IPC transport: trainer and engine share one GPU, so a bucket travels as a device-memory handle.

Per bucket, rank 0 copies the bucket's tensors (already cast to the engine's dtype, on the
trainer's GPU) into one flat device buffer, exports that buffer's CUDA IPC handle, and asks every
engine to take it (``POST /update_weights_from_cuda_ipc``). The engine maps the handle, copies the
tensors out of the mapped buffer into its own weights (a device-to-device copy: no file, no host
memory), unmaps it and answers; only then does the trainer drop the buffer.

Why a handle per bucket and not per tensor: opening an IPC handle costs a driver call, and a model
has hundreds of tensors; one flat buffer per bucket makes an update a few calls.

The handle is plain data (the fields ``UntypedStorage._share_cuda_`` returns, bytes as base64 in
JSON), never a pickle: the engine rebuilds it with ``torch.multiprocessing.reductions`` from those
fields alone. Both sides name the GPU by its UUID, so a handle can only be opened by an engine on the
trainer's own device; anything else is refused with the two UUIDs.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from miles.capabilities import EnginePrep, EngineSetup, TransportNeeds
from miles.errors import ConfigError
from miles_transports.bucket import Bucket, BucketedTransport, TransportOptions
from miles_transports.fanout import EngineFanout

if TYPE_CHECKING:
    import torch

IPC_ROUTE = "/update_weights_from_cuda_ipc"
# Each tensor starts at a multiple of this many bytes in the flat buffer, so every view is aligned for
# any dtype (and for vectorised copies).
ALIGN = 256


class IpcHandle(BaseModel):
    """A CUDA allocation shared between processes: what ``UntypedStorage._share_cuda_`` returns."""

    model_config = ConfigDict(extra="forbid")

    device_uuid: str = Field(..., description="the GPU's UUID (torch.cuda.get_device_properties().uuid)")
    handle: str = Field(..., description="cudaIpcMemHandle of the allocation, base64")
    size_bytes: int = Field(..., ge=0)
    offset_bytes: int = Field(..., ge=0, description="where the storage starts in the allocation")
    ref_counter_handle: str = Field(..., description="torch's shared reference counter, base64")
    ref_counter_offset: int = Field(..., ge=0)
    event_handle: str = Field(..., description="cudaIpcEventHandle the receiver waits on, base64")
    event_sync_required: bool


class IpcTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    dtype: str = Field(..., description="torch dtype name, e.g. bfloat16")
    shape: list[int]
    offset: int = Field(..., ge=0, description="byte offset in the shared buffer")


class IpcBucket(BaseModel):
    """The body of ``/update_weights_from_cuda_ipc``: one bucket of one update."""

    model_config = ConfigDict(extra="forbid")

    buffer: IpcHandle
    tensors: list[IpcTensor] = Field(..., min_length=1)
    weight_version: str | None = Field(
        None, description="set on the last bucket: commit and take this version"
    )
    bucket_index: int | None = Field(None, ge=0)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def device_uuid(device: torch.device) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def share_buffer(buffer: torch.Tensor) -> IpcHandle:
    """Export ``buffer``'s device memory (a flat uint8 CUDA tensor) as plain data."""
    (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        buffer.untyped_storage()._share_cuda_()
    )
    return IpcHandle(
        device_uuid=device_uuid(buffer.device),
        handle=_b64(handle),
        size_bytes=int(size),
        offset_bytes=int(offset),
        ref_counter_handle=_b64(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=_b64(event_handle or b""),
        event_sync_required=bool(event_sync),
    )


def open_buffer(shared: IpcHandle, device: torch.device) -> torch.Tensor:
    """Map a buffer another process on this GPU shared; raises ValueError if it is another GPU's."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if device.type != "cuda":
        raise ValueError(f"a CUDA IPC handle can only be opened by a CUDA engine; this one runs on {device}")
    mine = device_uuid(device)
    if shared.device_uuid != mine:
        raise ValueError(
            f"the buffer lives on GPU {shared.device_uuid}, this engine on {device} ({mine}): CUDA IPC "
            "hands weights over on one GPU only; start the engine on the trainer's device or use the "
            "broadcast transport"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(
        torch.Tensor,
        (shared.size_bytes,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        index,
        base64.b64decode(shared.handle),
        shared.size_bytes,
        shared.offset_bytes,
        False,
        base64.b64decode(shared.ref_counter_handle),
        shared.ref_counter_offset,
        base64.b64decode(shared.event_handle) or None,
        shared.event_sync_required,
    )


@dataclass
class FlatLayout:
    """Where each tensor of a bucket sits in the flat buffer."""

    tensors: list[IpcTensor]
    nbytes: int


def plan_layout(named: list[tuple[str, Any]]) -> FlatLayout:
    """Byte offsets (aligned to ALIGN) of each ``(name, tensor)`` in one flat buffer."""
    out: list[IpcTensor] = []
    offset = 0
    for name, t in named:
        out.append(
            IpcTensor(
                name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), offset=offset
            )
        )
        size = t.numel() * t.element_size()
        offset += -(-size // ALIGN) * ALIGN
    return FlatLayout(out, offset)


def views(buffer: torch.Tensor, tensors: list[IpcTensor]) -> dict[str, torch.Tensor]:
    """The named tensors inside a flat uint8 buffer (views: nothing is copied)."""
    import math

    import torch

    out: dict[str, torch.Tensor] = {}
    for spec in tensors:
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {spec.name!r}: {spec.dtype!r} is not a torch dtype")
        size = math.prod(spec.shape) * torch.empty((), dtype=dtype).element_size()
        if spec.offset % ALIGN or spec.offset + size > buffer.numel():
            raise ValueError(
                f"tensor {spec.name!r} at byte {spec.offset} ({size} bytes) does not lie aligned inside the "
                f"{buffer.numel()}-byte buffer"
            )
        out[spec.name] = buffer[spec.offset : spec.offset + size].view(dtype).view(spec.shape)
    return out


class CudaIpcOptions(TransportOptions):
    bucket_mb: float = Field(
        2048, description="bucket size: the whole of a small model in one buffer is one handle and one call"
    )
    timeout_s: float = Field(600.0, description="seconds one update may take")


class CudaIpcTransport(BucketedTransport):
    """``miles.interfaces.Transport`` through CUDA IPC handles on the GPU trainer and engine share."""

    carries_adapters = True  # a LoRA update is named tensors like any other

    needs = TransportNeeds(
        placement="colocated", launched_engines=True, receiver="cuda-ipc", device_type="cuda"
    )
    Options = CudaIpcOptions

    @staticmethod
    def prepare_engines(setup: EngineSetup) -> EnginePrep:
        """Cast on the trainer's GPU to the engines' dtype (half the bytes of float32 masters)."""
        if setup.options.get("dtype") is not None or setup.engine_dtype not in (
            "float32",
            "bfloat16",
            "float16",
        ):
            return EnginePrep()
        return EnginePrep(transport_options={"dtype": setup.engine_dtype})

    def __init__(
        self,
        bucket_mb: float = 2048,
        dtype: str | None = None,
        timeout_s: float = 600.0,
        check_equal: bool = False,
        check_mode: str = "exact",
        check_skip: list[str] | tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            bucket_mb=bucket_mb,
            dtype=dtype,
            check_equal=check_equal,
            check_mode=check_mode,
            check_skip=check_skip,
        )
        self.timeout_s = timeout_s
        self._engines: EngineFanout | None = None

    def _open(self) -> None:
        if not self.device.startswith("cuda"):
            raise ConfigError(
                f"cuda-ipc transport: the trainer runs on {self.device!r}; CUDA IPC needs the trainer and the "
                "engines on one CUDA device (fsdp.device: cuda, engine.device: cuda); on the CPU use the "
                "colocated transport"
            )
        self._engines = EngineFanout(self.engine_urls, self.timeout_s, name="miles-ipc")

    def _target_device(self) -> str:
        return self.device  # stay on the GPU: the cast happens there, and nothing visits the host

    def _send_bucket(self, bucket: Bucket, version: int) -> None:
        import torch

        from miles.engines.client import EngineCall

        assert self._engines is not None
        layout = plan_layout(bucket.tensors)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        for spec, (_, t) in zip(layout.tensors, bucket.tensors, strict=True):
            size = t.numel() * t.element_size()
            buffer[spec.offset : spec.offset + size].view(t.dtype).view(t.shape).copy_(t)
        body = IpcBucket(
            buffer=share_buffer(buffer),
            tensors=layout.tensors,
            weight_version=str(version) if bucket.last else None,
            bucket_index=bucket.index,
        )
        # The engine waits on the handle's event for the copies above, so no host synchronisation here.
        self._engines.call_all("call", EngineCall("POST", IPC_ROUTE, body.model_dump(mode="json")))
        del buffer  # every engine has copied out of it and unmapped it

    def _close(self) -> None:
        engines, self._engines = self._engines, None
        if engines is not None:
            engines.close()
