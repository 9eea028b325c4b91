"""Split a training batch across data-parallel ranks and micro-batches, and pad it into tensors.

The rows, their checks and the mini-batches are every backend's (``miles.train_rows``); this is
FSDP's part. The driver plans (cheap, no torch) and sends each rank only its rows; a rank turns
each micro-batch into right-padded tensors. Every rank must run the same number of
forward/backward passes (each one is a collective under FSDP), so a rank that has
fewer samples than the busiest one gets empty micro-batches, run as zero-weight
passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.routing import routing_shape
from miles.train_rows import Row, batch_rows, longest_first, pack_first_fit, sample_row
from miles.types import Sample, TrainBatch

if TYPE_CHECKING:
    import torch


@dataclass
class RankBatch:
    """One rank's share of a step: its micro-batches (possibly empty ones) and the global counts."""

    micro_batches: list[list[Row]]
    num_loss_tokens: int  # over the whole global batch: the token-mean denominator
    step: int
    num_samples: int = 0  # over the whole global batch: the per-sample-mean denominator
    packed: bool = False  # each micro-batch is one unpadded row of concatenated samples


def plan(lengths: list[int], world_size: int, micro_batch_size: int) -> list[list[list[int]]]:
    """Assign sample indices to ``[rank][micro_batch]``; every rank gets the same micro-batch count.

    Samples are dealt longest first, round-robin, so ranks get equal counts and
    similar token loads, and a micro-batch holds samples of similar length (less padding).
    Ranks with fewer samples get trailing empty micro-batches.
    """
    order = longest_first(lengths)
    per_rank = [order[r::world_size] for r in range(world_size)]
    n_micro = max(1, max((len(p) + micro_batch_size - 1) // micro_batch_size for p in per_rank))
    out: list[list[list[int]]] = []
    for rows in per_rank:
        mbs = [rows[k : k + micro_batch_size] for k in range(0, len(rows), micro_batch_size)]
        mbs += [[] for _ in range(n_micro - len(mbs))]
        out.append(mbs)
    return out


def plan_tokens(lengths: list[int], world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Like :func:`plan`, for packed micro-batches: at most ``max_tokens`` tokens each, not a sample count.

    Samples go longest first to the rank with the fewest tokens so far (ranks get similar token
    loads whatever the lengths), then each rank's samples are packed first-fit into micro-batches
    of at most ``max_tokens`` tokens; a sample longer than that gets a micro-batch of its own.
    Ranks with fewer micro-batches than the busiest get trailing empty ones.
    """
    loads = [0] * world_size
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for i in longest_first(lengths):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        per_rank[r].append(i)
        loads[r] += lengths[i]
    out = [pack_first_fit(rows, lengths, max_tokens) for rows in per_rank]
    n_micro = max(1, max(len(b) for b in out))
    return [bins + [[] for _ in range(n_micro - len(bins))] for bins in out]


def layout_for(
    lengths: list[int], world_size: int, micro_batch_size: int, max_tokens: int | None
) -> list[list[list[int]]]:
    """Packed micro-batches by token budget when ``max_tokens`` is set, else padded ones by count."""
    if max_tokens is None:
        return plan(lengths, world_size, micro_batch_size)
    return plan_tokens(lengths, world_size, max_tokens)


def split_batch(
    batch: TrainBatch,
    world_size: int,
    micro_batch_size: int,
    extra_scores: dict[str, list[list[float]]] | None = None,
    max_tokens: int | None = None,
) -> list[RankBatch]:
    """Each rank's rows of ``batch``; ``extra_scores`` adds per-token rows by name (in sample order)."""
    rows = batch_rows(batch, extra_scores)
    layout = layout_for([r.num_tokens for r in rows], world_size, micro_batch_size, max_tokens)
    total = batch.num_loss_tokens
    return [
        RankBatch(
            micro_batches=[[rows[i] for i in mb] for mb in mbs],
            num_loss_tokens=total,
            step=batch.step,
            num_samples=len(rows),
            packed=max_tokens is not None,
        )
        for mbs in layout
    ]


def split_for_scoring(
    samples: list[Sample], world_size: int, micro_batch_size: int, max_tokens: int | None = None
) -> tuple[list[RankBatch], list[list[list[int]]]]:
    """Each rank's rows for a forward-only scoring pass, and the layout to put the answers back in order."""
    rows = [sample_row(s) for s in samples]
    layout = layout_for([r.num_tokens for r in rows], world_size, micro_batch_size, max_tokens)
    shares = [
        RankBatch(
            micro_batches=[[rows[i] for i in mb] for mb in mbs],
            num_loss_tokens=0,
            step=-1,
            packed=max_tokens is not None,
        )
        for mbs in layout
    ]
    return shares, layout


@dataclass
class MicroBatchTensors:
    """A micro-batch, right-padded (or packed). ``[B, R]`` tensors are aligned on response tokens."""

    input_ids: torch.Tensor  # [B, L]; packed: [1, T], the B samples one after another
    rows: torch.Tensor  # [N] flat indices into the [B*L] (packed: [T]) logits that predict a response token
    targets: torch.Tensor  # [N] the response token each of those rows predicts
    slots: torch.Tensor  # [N] flat indices into the [B*R] response grid
    rollout_logprobs: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B, R]
    loss_mask: torch.Tensor  # [B, R] float
    num_tokens: int  # real (unpadded) tokens, prompt + response
    num_loss_tokens: int
    scores: dict[str, torch.Tensor]  # [B, R] each, the rows' named per-token extras
    # Packed: [1, T] positions restarting at 0 for each sample, which is how the model (transformers'
    # packed-sequence masks, flash-attention's varlen path) keeps samples from attending to each other.
    position_ids: torch.Tensor | None = None
    # Packed: the samples' boundaries as transformers' variable-length attention keyword arguments
    # (``cu_seq_lens_q`` ...), which attention backends that take boundaries read (miles_varlen,
    # flash_attention_2) and the mask-based ones ignore.
    boundaries: dict[str, Any] | None = None
    # MoE, when a row carries routing: [B*L] (packed: [T]) positions in the flattened order the routers
    # see them, x sparse layer x k, int64: the experts the rollout routed each position to, -1 where it
    # recorded none (padding, each sample's last token, rows without routing).
    routing: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, Any]:
        """The keyword arguments of the model's forward for this micro-batch."""
        if self.position_ids is None:
            return {"input_ids": self.input_ids}
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, **(self.boundaries or {})}


def collate(
    rows: list[Row], device: torch.device | str, pad_id: int = 0, *, packed: bool = False
) -> MicroBatchTensors:
    import torch

    from miles_fsdp.attention import segment_kwargs

    b = len(rows)
    seq_len = sum(r.num_tokens for r in rows) if packed else max(r.num_tokens for r in rows)
    resp_len = max(1, max(len(r.response_ids) for r in rows))
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    rollout = torch.zeros(b, resp_len, dtype=torch.float32)
    adv = torch.zeros(b, resp_len, dtype=torch.float32)
    mask = torch.zeros(b, resp_len, dtype=torch.float32)
    logit_rows: list[int] = []
    targets: list[int] = []
    slots: list[int] = []
    names = sorted({name for r in rows for name in r.scores})
    for name in names:
        missing = [i for i, r in enumerate(rows) if name not in r.scores]
        if missing:
            raise ValueError(
                f"collate: rows {missing} lack the per-token score {name!r} that other rows carry"
            )
    scores = {name: torch.zeros(b, resp_len, dtype=torch.float32) for name in names}
    if packed:
        input_ids = torch.full((1, seq_len), pad_id, dtype=torch.long)
        positions = torch.zeros(1, seq_len, dtype=torch.long)
    offset = 0  # packed: where row i starts in the one sequence
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        if packed:
            input_ids[0, offset : offset + p + n] = torch.tensor(
                r.prompt_ids + r.response_ids, dtype=torch.long
            )
            positions[0, offset : offset + p + n] = torch.arange(p + n)
            start = offset
            offset += p + n
        else:
            input_ids[i, : p + n] = torch.tensor(r.prompt_ids + r.response_ids, dtype=torch.long)
            start = i * seq_len
        rollout[i, :n] = torch.tensor(r.rollout_logprobs, dtype=torch.float32)
        adv[i, :n] = torch.tensor(r.advantages, dtype=torch.float32)
        mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
        for name in names:
            scores[name][i, :n] = torch.tensor(r.scores[name], dtype=torch.float32)
        # Response token j sits at position p + j and is predicted by the logits at p + j - 1.
        logit_rows.extend(start + p - 1 + j for j in range(n))
        targets.extend(r.response_ids)
        slots.extend(i * resp_len + j for j in range(n))
    return MicroBatchTensors(
        input_ids=input_ids.to(device),
        rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        rollout_logprobs=rollout.to(device),
        advantages=adv.to(device),
        loss_mask=mask.to(device),
        num_tokens=sum(r.num_tokens for r in rows),
        num_loss_tokens=int(sum(sum(r.loss_mask) for r in rows)),
        scores={name: t.to(device) for name, t in scores.items()},
        position_ids=positions.to(device) if packed else None,
        boundaries=segment_kwargs([r.num_tokens for r in rows], device) if packed else None,
        routing=routing_grid(rows, seq_len, packed=packed, device=device),
    )


def routing_grid(
    rows: list[Row], seq_len: int, *, packed: bool, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """The rows' recorded routing laid out like the micro-batch's tokens, flattened as the routers see them.

    Padded: row ``i``'s position ``t`` is ``i * seq_len + t``; packed: the rows follow each other in one
    sequence of ``seq_len`` tokens. Positions without a recorded routing hold -1. None when no row
    carries routing.
    """
    import torch

    shapes = {shape for r in rows if (shape := routing_shape(r.routing or [])) is not None}
    if not shapes:
        return None
    if len(shapes) != 1:
        raise ValueError(f"collate: the rows' routing has different (layers, top-k) shapes {sorted(shapes)}")
    ((layers, topk),) = shapes
    total = seq_len if packed else len(rows) * seq_len
    grid = torch.full((total, layers, topk), -1, dtype=torch.long)
    offset = 0
    for i, r in enumerate(rows):
        start = offset if packed else i * seq_len
        if r.routing:
            if len(r.routing) != r.num_tokens - 1:
                raise ValueError(
                    f"collate: row {i} has routing for {len(r.routing)} positions; its {r.num_tokens} tokens "
                    f"need {r.num_tokens - 1} (every position but the last)"
                )
            grid[start : start + len(r.routing)] = torch.tensor(r.routing, dtype=torch.long)
        offset += r.num_tokens
    return grid.to(device)
