"""The one place that initialises and tears down megatron-core's parallel-state globals.

The rest of the backend reads sizes and coordinates from the ``ParallelLayout``; only
``megatron_parallel`` calls ``megatron.core.parallel_state`` (and ``torch.distributed``'s
process group when it is not already up).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from miles_megatron.layout import ParallelLayout


@contextmanager
def megatron_parallel(layout: ParallelLayout, rank: int, backend: str, init_method: str) -> Iterator[None]:
    """megatron-core's process groups for ``layout`` on this rank, destroyed on exit."""
    from megatron.core import parallel_state  # type: ignore[import-untyped]

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=layout.world)
    elif dist.get_world_size() != layout.world:
        raise RuntimeError(f"the process group has {dist.get_world_size()} ranks, the layout {layout.world}")
    parallel_state.initialize_model_parallel(**layout.megatron_kwargs())
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owns_group:
            dist.destroy_process_group()
