"""A train batch in megatron-core's input layout (CPU-testable; imports torch, not megatron-core).

Each sample becomes one row: ``tokens`` (prompt then response), ``position_ids``, and, in
megatron's next-token convention, ``labels[t] = tokens[t + 1]`` with ``label_mask[t] = 1``
where ``labels[t]`` is a response token the loss trains on. Rows are right-padded: under the
causal mask a real token never attends to the padding after it, so no attention mask is needed
(``attention_mask=None``). Packed micro-batches (one ``[1, T]`` row of concatenated samples,
positions restarting at 0) carry ``cu_seqlens`` for megatron's ``PackedSeqParams`` (THD
format, which only Transformer Engine's attention reads).

Alongside, the ``[B, R]`` response grids the ``Loss`` protocol takes (``LossInputs``): log-probs
are read at ``rows`` of the flattened ``[B * L]`` logits, predict ``targets``, and land in
``slots`` of the flattened ``[B * R]`` grid.

MoE samples that carry the rollout's routing (``miles.routing``) get it as ``MicroBatch.routing``,
laid out as megatron's routers see the tokens: hidden states are ``[L, B, H]`` (sequence first)
inside the model, flattened to ``L * B`` rows, so position ``t`` of row ``b`` is ``t * B + b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles.routing import routing_shape
from miles.train_rows import Row, longest_first, pack_first_fit


def plan_micro_batches(
    lengths: list[int], micro_batch_size: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Sample indices per micro-batch, longest first: ``micro_batch_size`` samples each, or (packed)
    at most ``max_tokens`` tokens each, first-fit (a longer sample gets one of its own)."""
    order = longest_first(lengths)
    if max_tokens is None:
        return [order[k : k + micro_batch_size] for k in range(0, len(order), micro_batch_size)]
    return pack_first_fit(order, lengths, max_tokens)


@dataclass
class MicroBatch:
    """One micro-batch in megatron's layout plus the ``[B, R]`` response grids of ``LossInputs``."""

    tokens: torch.Tensor  # [B, L] (packed: [1, T])
    position_ids: torch.Tensor  # [B, L]
    labels: torch.Tensor  # [B, L]: tokens[t + 1] (0 past the end)
    label_mask: torch.Tensor  # [B, L] float: 1 where labels[t] is a trained response token
    rows: torch.Tensor  # [N] flat indices into [B * L] logits that predict a response token
    targets: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] flat indices into the [B * R] grid
    loss_mask: torch.Tensor  # [B, R] float
    rollout_logprobs: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B, R]
    scores: dict[str, torch.Tensor]  # [B, R] each
    num_tokens: int
    num_loss_tokens: int
    response_lengths: list[int]
    cu_seqlens: torch.Tensor | None = None  # packed: [n + 1] int32 sample boundaries
    max_seqlen: int | None = None
    # MoE: [L * B] positions (sequence first, as the routers see them) x sparse layer x k, int64: the
    # experts the rollout routed each position to, -1 where none was recorded. None: no row carries any.
    routing: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        moved: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
            elif name == "scores":
                moved[name] = {k: v.to(device, non_blocking=True) for k, v in value.items()}
            else:
                moved[name] = value
        return MicroBatch(**moved)

    def grid(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-row values ``[N]`` (in ``rows`` order) put into the ``[B, R]`` response grid."""
        b, r = self.loss_mask.shape
        out = torch.zeros(b * r, dtype=torch.float32, device=flat.device)
        return out.index_put((self.slots,), flat.float()).view(b, r)


def collate(rows: list[Row], *, packed: bool = False, pad_id: int = 0) -> MicroBatch:
    """``rows`` as one micro-batch (CPU tensors): right-padded rows, or one packed row."""
    if not rows:
        raise ValueError("collate: a micro-batch needs at least one row")
    b = len(rows)
    lengths = [r.num_tokens for r in rows]
    seq_len = sum(lengths) if packed else max(lengths)
    n_rows = 1 if packed else b
    resp_len = max(1, max(len(r.response_ids) for r in rows))
    tokens = torch.full((n_rows, seq_len), pad_id, dtype=torch.long)
    positions = torch.zeros(n_rows, seq_len, dtype=torch.long)
    label_mask = torch.zeros(n_rows, seq_len, dtype=torch.float32)
    names = sorted({name for r in rows for name in r.scores})
    for name in names:
        missing = [i for i, r in enumerate(rows) if name not in r.scores]
        if missing:
            raise ValueError(
                f"collate: rows {missing} lack the per-token score {name!r} that other rows carry"
            )
    grids = {k: torch.zeros(b, resp_len) for k in ("loss_mask", "rollout", "adv", *names)}
    flat_rows: list[int] = []
    targets: list[int] = []
    slots: list[int] = []
    offset = 0
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        row, col = (0, offset) if packed else (i, 0)
        tokens[row, col : col + p + n] = torch.tensor(r.prompt_ids + r.response_ids, dtype=torch.long)
        positions[row, col : col + p + n] = torch.arange(p + n)
        # Response token j sits at p + j and is predicted at p + j - 1.
        for j in range(n):
            label_mask[row, col + p - 1 + j] = float(r.loss_mask[j])
        start = col if packed else i * seq_len
        flat_rows.extend(start + p - 1 + j for j in range(n))
        targets.extend(r.response_ids)
        slots.extend(i * resp_len + j for j in range(n))
        grids["loss_mask"][i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
        grids["rollout"][i, :n] = torch.tensor(r.rollout_logprobs, dtype=torch.float32)
        grids["adv"][i, :n] = torch.tensor(r.advantages, dtype=torch.float32)
        for name in names:
            grids[name][i, :n] = torch.tensor(r.scores[name], dtype=torch.float32)
        offset += p + n
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    if packed:  # the last token of a sample predicts nothing of the next one
        ends = torch.tensor(lengths).cumsum(0) - 1
        labels[0, ends] = 0
    cu = None
    if packed:
        cu = torch.zeros(b + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return MicroBatch(
        tokens=tokens,
        position_ids=positions,
        labels=labels,
        label_mask=label_mask,
        rows=torch.tensor(flat_rows, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        slots=torch.tensor(slots, dtype=torch.long),
        loss_mask=grids["loss_mask"],
        rollout_logprobs=grids["rollout"],
        advantages=grids["adv"],
        scores={name: grids[name] for name in names},
        num_tokens=sum(lengths),
        num_loss_tokens=int(sum(sum(r.loss_mask) for r in rows)),
        response_lengths=[len(r.response_ids) for r in rows],
        cu_seqlens=cu,
        max_seqlen=max(lengths) if packed else None,
        routing=routing_grid(rows, seq_len, packed=packed),
    )


def routing_grid(rows: list[Row], seq_len: int, *, packed: bool) -> torch.Tensor | None:
    """The rows' recorded routing in the order megatron's routers see the tokens (sequence first).

    The micro-batch is ``[n_rows, seq_len]`` tokens (packed: one row); inside the model they are
    ``[seq_len, n_rows]``, so position ``t`` of row ``b`` is router row ``t * n_rows + b``. Positions
    without a recorded routing hold -1. None when no row carries routing.
    """
    shapes = {shape for r in rows if (shape := routing_shape(r.routing or [])) is not None}
    if not shapes:
        return None
    if len(shapes) != 1:
        raise ValueError(f"collate: the rows' routing has different (layers, top-k) shapes {sorted(shapes)}")
    ((layers, topk),) = shapes
    n_rows = 1 if packed else len(rows)
    grid = torch.full((n_rows, seq_len, layers, topk), -1, dtype=torch.long)
    offset = 0
    for i, r in enumerate(rows):
        row, col = (0, offset) if packed else (i, 0)
        if r.routing:
            if len(r.routing) != r.num_tokens - 1:
                raise ValueError(
                    f"collate: row {i} has routing for {len(r.routing)} positions; its {r.num_tokens} tokens "
                    f"need {r.num_tokens - 1} (every position but the last)"
                )
            grid[row, col : col + len(r.routing)] = torch.tensor(r.routing, dtype=torch.long)
        offset += r.num_tokens
    return grid.transpose(0, 1).reshape(seq_len * n_rows, layers, topk)


def token_logprobs(
    logits: torch.Tensor, mb: MicroBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the entropy at their positions, as ``[B, R]`` grids.

    ``logits`` is the model's ``[B, L, V]`` output; only the rows that predict a response token
    are read (in float32, divided by the sampling temperature). Differentiable.
    """
    flat = logits.reshape(-1, logits.shape[-1]).index_select(0, mb.rows).float()
    if temperature != 1.0:
        flat = flat / temperature
    logp = torch.log_softmax(flat, dim=-1)
    lp = logp.gather(1, mb.targets[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return mb.grid(lp), mb.grid(entropy)
