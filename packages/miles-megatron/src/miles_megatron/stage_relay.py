"""Every pipeline stage's exported weights brought to the rank that delivers them to the engines.

Under PP each stage holds only its own layers (the embedding on the first stage, the final norm and
output layer on the last). Each stage exports its own: its ranks gather their TP shards
(``export.iter_export``) and the stage's export source (``ParallelLayout.export_sources``, one per
stage) sends the full HF tensors on, one at a time, to rank 0, the rank the transports deliver from
(``StreamTransport``: rank 0 talks to the engines, the other ranks drain the stream). Rank 0's
stream is its own stage's tensors, then each later stage's in stage order; the other ranks' streams
yield nothing (draining them does their stage's gathers and sends). With PP = 1 the stream is the
rank's own, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from miles_megatron.layout import ParallelLayout

Named = Iterator[tuple[str, torch.Tensor]]


def relay_stages(layout: ParallelLayout, rank: int, own: Named, device: torch.device) -> Named:
    """``own`` (this rank's stage, in HF names) merged over the pipeline stages onto rank 0 (see module)."""
    if layout.pp == 1:
        yield from own
        return
    sources = layout.export_sources()  # stage order; stage 0's is rank 0
    if rank == sources[0]:
        yield from own
        for source in sources[1:]:
            yield from _receive(source, device)
    elif rank in sources:
        for name, tensor in own:
            # The header first: rank 0 cannot know a stage's names and shapes without building its rules.
            dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=sources[0])
            dist.send(tensor.contiguous(), dst=sources[0])
        dist.send_object_list([None], dst=sources[0])  # this stage is done
    else:
        for _ in own:  # the TP gathers of this rank's stage
            pass


def _receive(source: int, device: torch.device) -> Named:
    while True:
        header: list[tuple[str, tuple[int, ...], torch.dtype] | None] = [None]
        dist.recv_object_list(header, src=source)
        if header[0] is None:
            return
        name, shape, dtype = header[0]
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=source)
        yield name, tensor
