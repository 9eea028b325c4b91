"""Forward (and backward) over a step's micro-batches: megatron's schedule on CUDA, the same loop
in-process on the CPU (megatron's no-pipelining schedule allocates on CUDA), and megatron's pipeline
schedule on both under PP > 1 (``miles_megatron.pipeline``). The policy's trainer and the critic both
run their passes through it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from miles_megatron.batch import MicroBatch

# megatron's forward-step contract: (data iterator, model) -> (output, reduce) where reduce(output)
# gives (loss scaled by the micro-batch count, what the step keeps of this micro-batch).
ForwardStep = Callable[[Iterator[MicroBatch], Any], tuple[torch.Tensor, Callable[[torch.Tensor], Any]]]


def run_micro_batches(
    model: Any,
    micro_batches: list[MicroBatch],
    forward_step: ForwardStep,
    *,
    cuda: bool,
    forward_only: bool,
    stages: int = 1,
) -> list[Any]:
    """What ``reduce`` kept of each micro-batch, in order; unless ``forward_only``, each micro-batch's
    loss / n has been back-propagated (gradients accumulate over the step). ``stages``: the pipeline's
    (PP); with more than one, ``reduce`` runs on the last stage and every stage gets what it kept."""
    if stages > 1:
        from miles_megatron.pipeline import run_pipeline

        return run_pipeline(model, micro_batches, forward_step, cuda=cuda, forward_only=forward_only)
    n = len(micro_batches)
    if not cuda:
        data = iter(micro_batches)
        outs = []
        for _ in range(n):
            output, reduce = forward_step(data, model)
            loss, kept = reduce(output)
            if not forward_only:
                (loss / n).backward()
            outs.append(kept)
        return outs
    from megatron.core.pipeline_parallel import get_forward_backward_func  # type: ignore[import-untyped]

    return list(
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=n,
            seq_length=max(int(mb.tokens.shape[1]) for mb in micro_batches),
            micro_batch_size=max(int(mb.tokens.shape[0]) for mb in micro_batches),
            forward_only=forward_only,
        )
    )
