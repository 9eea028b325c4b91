"""A train batch as every training backend sees it: one ``Row`` per sample, checked, split into
mini-batches (one per optimizer step) and packed into micro-batches. Plain Python, no torch: the
driver side of a backend plans with it and sends each rank only its rows.

What stays in a backend is what is its own: how rows become tensors (padded or packed, FSDP's
batch-first or megatron's sequence-first routing layout) and how micro-batches are dealt to ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from miles.errors import ComponentError
from miles.routing import ExpertRow, replay_problem, sequence_routing
from miles.types import Sample, TrainBatch

# Token scores the trainer reads during the step; everything else in token_scores stays on the driver.
TRAIN_SCORES = ("ref_logprobs", "values")
# The policy's own log-probs before the first of several optimizer steps on one batch (PPO's "old").
OLD_LOGPROBS = "old_logprobs"


@dataclass
class Row:
    """The trainer's view of one sample: only what the loss needs, cheap to send to a rank."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    advantages: list[float]
    # Per-token extras by name (reference log-probs, the critic's old values, returns).
    scores: dict[str, list[float]] = field(default_factory=dict)
    # MoE: the experts the rollout routed each position to, every position but the last
    # (miles.routing.sequence_routing); None when the sample carries no routing.
    routing: list[ExpertRow] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def sample_row(
    sample: Sample, advantages: list[float] | None = None, scores: dict[str, list[float]] | None = None
) -> Row:
    """One sample's row; without ``advantages`` (a scoring pass) they are zeros."""
    return Row(
        prompt_ids=list(sample.prompt_ids),
        response_ids=list(sample.response_ids),
        loss_mask=list(sample.loss_mask),
        rollout_logprobs=list(sample.rollout_logprobs),
        advantages=list(advantages) if advantages is not None else [0.0] * len(sample.response_ids),
        scores=scores or {},
        routing=sequence_routing(sample),
    )


def batch_rows(batch: TrainBatch, extra: dict[str, list[list[float]]] | None = None) -> list[Row]:
    """The rows of ``batch`` in sample order, with the token scores the step reads, the returns
    (PPO) and ``extra`` per-token rows by name (e.g. :data:`OLD_LOGPROBS`)."""
    rows = []
    for i, (s, adv) in enumerate(zip(batch.samples, batch.advantages, strict=True)):
        scores = {name: s.token_scores[name] for name in TRAIN_SCORES if name in s.token_scores}
        if batch.returns is not None:
            scores["returns"] = batch.returns[i]
        for name, per_sample in (extra or {}).items():
            scores[name] = per_sample[i]
        rows.append(sample_row(s, adv, scores))
    return rows


def check_batch(batch: TrainBatch, *, replay: bool = False) -> None:
    """Raise on a batch the trainer cannot use, naming the sample and the field.

    A bad batch comes from the rollout function or the advantage estimator (both
    pluggable), so it is reported as a component error, before any rank sees it.
    ``replay``: routing replay is on, so every sample must carry the routing of every position.
    """
    if not batch.samples:
        raise ComponentError(f"train batch of step {batch.step} has no samples")
    for i, (sample, adv) in enumerate(zip(batch.samples, batch.advantages, strict=True)):
        where = f"train batch of step {batch.step}, sample {i} (prompt {sample.prompt.index})"
        if not sample.prompt_ids:
            raise ComponentError(
                f"{where}: prompt_ids is empty; the first response token needs a prompt to follow"
            )
        try:
            sample.check_aligned()
        except ValueError as exc:
            raise ComponentError(f"{where}: {exc}") from None
        if batch.returns is not None and len(batch.returns[i]) != len(sample.response_ids):
            raise ComponentError(
                f"{where}: {len(batch.returns[i])} returns for {len(sample.response_ids)} response tokens"
            )
        if len(adv) != len(sample.response_ids):
            raise ComponentError(
                f"{where}: {len(adv)} advantages for {len(sample.response_ids)} response tokens; "
                "the advantage estimator must return one value per response token"
            )
        problem = replay_problem(sample) if replay else None
        if problem is not None:
            raise ComponentError(f"{where}: train.use_rollout_routing_replay is on, but the sample {problem}")
    if batch.num_loss_tokens == 0:
        raise ComponentError(
            f"train batch of step {batch.step}: no sample has a loss token (every loss_mask is 0)"
        )


def mini_batches(num_samples: int, steps: int) -> list[range]:
    """Split ``num_samples`` (in batch order) into ``steps`` contiguous, near-equal mini-batches.

    Contiguous keeps a group's samples together (the batch is groups, flattened); sizes differ
    by at most one. Fewer samples than steps give one mini-batch per sample.
    """
    steps = max(1, min(steps, num_samples))
    base, extra = divmod(num_samples, steps)
    out, start = [], 0
    for k in range(steps):
        size = base + (1 if k < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def sub_batch(batch: TrainBatch, indices: Sequence[int]) -> TrainBatch:
    """The samples ``indices`` of ``batch`` as a batch of their own (one optimizer step's data)."""
    return TrainBatch(
        samples=[batch.samples[i] for i in indices],
        advantages=[batch.advantages[i] for i in indices],
        step=batch.step,
        returns=None if batch.returns is None else [batch.returns[i] for i in indices],
    )


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Sample indices by decreasing length (ties in batch order): similar lengths share a micro-batch."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def pack_first_fit(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """``indices`` (longest first) packed into micro-batches of at most ``max_tokens`` tokens,
    first-fit decreasing; a sample longer than ``max_tokens`` gets a micro-batch of its own."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in indices:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins
