"""Pipeline parallelism: a step's micro-batches through megatron-core's own 1F1B schedule.

``run_pipeline`` calls ``get_forward_backward_func()`` (megatron's non-interleaved 1F1B schedule
when PP > 1) with megatron's P2P communication between stages; the loss function runs on the last
stage only, so what it kept of each micro-batch is broadcast from there to every rank of the
pipeline group (each rank answers the driver the same: log-probs, losses, metrics).

On CUDA megatron's own ``P2PCommunicator`` is used as it is. On the CPU (``megatron.device: cpu``,
gloo) two things in megatron-core 0.16 allocate on CUDA unconditionally, and each is handled through
an API rather than by patching megatron:

- the communicator's receive buffers (``torch.cuda.current_device()`` in ``_communicate``): the
  schedule takes a communicator object (``p2p_communicator=`` with its ``pg_collection=``), so
  :class:`CPUP2PCommunicator`, a subclass, is passed in its place; it exchanges the same tensors
  with the same peers over the pipeline group, with its buffers on the CPU;
- the schedule's token counter (``torch.zeros([], device="cuda")``): while the schedule runs,
  :class:`miles_megatron.cpu.CudaOnCPU`, a torch function mode (torch's override protocol, the
  mechanism behind ``with torch.device(...)``), puts tensors that a factory call asks for on "cuda" on
  the CPU.

Micro-batches have different shapes (rows are padded to their micro-batch's longest), so the
model's config has ``variable_seq_lengths`` on under PP (``model_config.transformer_config``) and
each activation's shape travels before it, as megatron does for that setting.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state  # type: ignore[import-untyped]
from megatron.core.pipeline_parallel import get_forward_backward_func  # type: ignore[import-untyped]
from megatron.core.pipeline_parallel.p2p_communication import (  # type: ignore[import-untyped]
    P2PCommunicator,
)
from megatron.core.process_groups_config import ProcessGroupCollection  # type: ignore[import-untyped]

from miles_megatron.batch import MicroBatch
from miles_megatron.cpu import CudaOnCPU
from miles_megatron.schedule import ForwardStep

# The process groups megatron's non-interleaved schedule reads from a passed-in collection.
_SCHEDULE_GROUPS = ["tp", "cp", "pp", "embd", "pos_embd", "dp_cp"]


class CPUP2PCommunicator(P2PCommunicator):
    """megatron's stage-to-stage communicator with its receive buffers on the CPU (gloo).

    It overrides megatron's ``_communicate``, the one method its public send / receive methods (the
    schedule's calls) go through; private in megatron-core 0.16.1, where it was run. Same contract:
    send ``tensor_send_next`` / ``tensor_send_prev``
    to the next / previous stage, receive from them when asked, and return the received tensors
    (leaf tensors that require a gradient, in ``config.pipeline_dtype``). Every request is waited
    on before returning, as megatron does with ``wait_on_reqs`` (the non-interleaved schedule's case).
    """

    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Any,
        wait_on_reqs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        if self.config.variable_seq_lengths:
            prev_shape, next_shape = self._exchange(
                _shape_of(tensor_send_next),
                _shape_of(tensor_send_prev),
                torch.empty(3, dtype=torch.int64) if recv_prev else None,
                torch.empty(3, dtype=torch.int64) if recv_next else None,
            )
            prev_dims = prev_shape.tolist() if prev_shape is not None else []
            next_dims = next_shape.tolist() if next_shape is not None else []
        else:
            prev_dims = next_dims = list(tensor_shape)
        dtype = self.config.pipeline_dtype
        prev = torch.empty(prev_dims, dtype=dtype, requires_grad=True) if recv_prev else None
        nxt = torch.empty(next_dims, dtype=dtype, requires_grad=True) if recv_next else None
        self._exchange(tensor_send_next, tensor_send_prev, prev, nxt)
        return prev, nxt, None

    def _exchange(
        self,
        send_next: torch.Tensor | None,
        send_prev: torch.Tensor | None,
        recv_prev: torch.Tensor | None,
        recv_next: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # Every send and receive posted before any is waited on: two neighbours that both send and
        # receive in one call (the 1F1B steady state) cannot block each other.
        group = self.pp_group
        requests = []
        if send_prev is not None:
            requests.append(dist.isend(send_prev.contiguous(), self.prev_rank, group=group))
        if recv_prev is not None:
            requests.append(dist.irecv(recv_prev, self.prev_rank, group=group))
        if send_next is not None:
            requests.append(dist.isend(send_next.contiguous(), self.next_rank, group=group))
        if recv_next is not None:
            requests.append(dist.irecv(recv_next, self.next_rank, group=group))
        for request in requests:
            if request is not None:  # None only for a rank outside the group, which this one is not
                request.wait()
        return recv_prev, recv_next


def _shape_of(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else torch.tensor(tensor.shape, dtype=torch.int64)


def run_pipeline(
    model: Any, micro_batches: list[MicroBatch], forward_step: ForwardStep, *, cuda: bool, forward_only: bool
) -> list[Any]:
    """What the loss function kept of each micro-batch (on every rank of the pipeline group), through
    megatron's pipeline schedule; unless ``forward_only`` the gradients of the step are accumulated."""
    extra: dict[str, Any] = {}
    mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if not cuda:
        config = model.config
        extra = {
            "p2p_communicator": CPUP2PCommunicator(
                pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config
            ),
            "pg_collection": ProcessGroupCollection.use_mpu_process_groups(_SCHEDULE_GROUPS),
        }
        mode = CudaOnCPU()
    with mode:
        kept = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(int(mb.tokens.shape[1]) for mb in micro_batches),
            micro_batch_size=max(int(mb.tokens.shape[0]) for mb in micro_batches),
            forward_only=forward_only,
            **extra,
        )
    return from_last_stage(list(kept))


def from_last_stage(kept: list[Any]) -> list[Any]:
    """The last stage's ``kept`` on every rank of this rank's pipeline group (the others have nothing)."""
    box = [kept]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return list(box[0])
