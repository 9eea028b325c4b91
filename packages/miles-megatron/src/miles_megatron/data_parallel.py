"""Data parallelism of the CPU trainer (``megatron.device: cpu``): the batch split over DP ranks.

Each DP rank takes every ``dp``-th micro-batch of the step (the same on the ranks of its TP
group), runs its forward and backward, and the gradients are summed over the DP group before
the optimizer step. The loss functions normalise by the whole step's token and sample counts
(``LossInputs.num_loss_tokens`` / ``num_samples``), so the sum of the DP ranks' gradients is the
gradient of the whole batch: a DP = 2 step equals the DP = 1 step. Metrics and scores are
gathered back over the group so that rank 0 answers for the whole batch.

On CUDA megatron's ``DistributedDataParallel`` does the reduction; that path is not launched
yet (``hooks.launch_problems``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def dp_share(items: Sequence[T], dp_rank: int, dp_size: int) -> list[T]:
    """The items DP rank ``dp_rank`` of ``dp_size`` takes: every ``dp_size``-th, from its own index."""
    return list(items[dp_rank::dp_size])


def interleave(shares: Sequence[Sequence[T]]) -> list[T]:
    """Undo :func:`dp_share`: ``shares[r]`` is rank r's share; the items in their original order."""
    out: list[T] = []
    for i in range(max((len(s) for s in shares), default=0)):
        out.extend(s[i] for s in shares if i < len(s))
    return out


def gather_shares(share: list[Any], group: Any) -> list[list[Any]]:
    """Every DP rank's ``share`` (small Python values: metrics, log-prob lists), in rank order."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, share, group=group)
    return out


def sum_gradients(params: Sequence[torch.nn.Parameter], group: Any) -> None:
    """Sum ``params``' gradients over the DP group, in one flat all-reduce.

    A rank whose share was empty (fewer micro-batches than DP ranks) has no gradients: it
    contributes zeros and receives the others' sum.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
