"""A train batch in megatron's input layout (CPU): tokens, positions, labels, loss mask, packing, log-probs."""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import make_batch

from miles.errors import ComponentError
from miles.train_rows import batch_rows, check_batch, mini_batches
from miles_megatron.batch import collate, plan_micro_batches, token_logprobs


def test_padded_rows_follow_megatrons_next_token_convention():
    batch = make_batch(4, seed=3)
    rows = batch_rows(batch)
    mb = collate(rows)
    b, length = mb.tokens.shape
    assert b == 4 and length == max(r.num_tokens for r in rows)
    for i, r in enumerate(rows):
        n = r.num_tokens
        assert mb.tokens[i, :n].tolist() == r.prompt_ids + r.response_ids
        assert mb.tokens[i, n:].eq(0).all()
        assert mb.position_ids[i, :n].tolist() == list(range(n))
        assert mb.labels[i, : n - 1].tolist() == (r.prompt_ids + r.response_ids)[1:]
        p = len(r.prompt_ids)
        assert mb.label_mask[i].tolist() == [0.0] * (p - 1) + [float(m) for m in r.loss_mask] + [0.0] * (
            length - n + 1
        )
    # the rows that predict response tokens are where the labels are those tokens
    assert torch.equal(mb.labels.reshape(-1)[mb.rows], mb.targets)
    assert mb.label_mask.sum().item() == mb.num_loss_tokens == batch.num_loss_tokens
    assert mb.cu_seqlens is None and mb.max_seqlen is None
    assert mb.loss_mask.shape == mb.advantages.shape == (4, max(len(r.response_ids) for r in rows))
    grid = mb.grid(mb.targets.float())
    for i, r in enumerate(rows):
        assert grid[i, : len(r.response_ids)].tolist() == [float(t) for t in r.response_ids]


def test_packed_rows_restart_positions_and_carry_cu_seqlens():
    rows = batch_rows(make_batch(3, seed=5))
    mb = collate(rows, packed=True)
    lengths = [r.num_tokens for r in rows]
    assert mb.tokens.shape == (1, sum(lengths))
    assert mb.cu_seqlens is not None and mb.cu_seqlens.dtype == torch.int32
    assert mb.cu_seqlens.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert mb.max_seqlen == max(lengths)
    start = 0
    for n in lengths:
        assert mb.position_ids[0, start : start + n].tolist() == list(range(n))
        assert mb.labels[0, start + n - 1].item() == 0  # a sample's last token predicts nothing
        start += n
    assert torch.equal(mb.labels.reshape(-1)[mb.rows], mb.targets)
    assert mb.label_mask.sum().item() == mb.num_loss_tokens


def test_packed_seq_params_are_megatrons_thd_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    from miles_megatron.trainer import packed_seq_params

    mb = collate(batch_rows(make_batch(3, seed=6)), packed=True)
    params = packed_seq_params(PackedSeqParams, mb)
    assert params.qkv_format == "thd"
    assert torch.equal(params.cu_seqlens_q, mb.cu_seqlens) and torch.equal(
        params.cu_seqlens_kv, mb.cu_seqlens
    )
    assert params.max_seqlen_q == params.max_seqlen_kv == mb.max_seqlen


@pytest.mark.parametrize("packed", [False, True])
def test_token_logprobs_equal_a_plain_log_softmax_and_carry_gradients(packed):
    torch.manual_seed(0)
    rows = batch_rows(make_batch(4, seed=7))
    mb = collate(rows, packed=packed)
    logits = torch.randn(*mb.tokens.shape, 96, requires_grad=True)
    lp, ent = token_logprobs(logits, mb, temperature=0.7)
    ref = torch.log_softmax(logits.detach() / 0.7, dim=-1)
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        seq = 0 if packed else i
        off = sum(x.num_tokens for x in rows[:i]) if packed else 0
        for j, tok in enumerate(r.response_ids):
            want = ref[seq, off + p - 1 + j, tok]
            assert lp[i, j].item() == pytest.approx(want.item(), abs=1e-6)
            h = -(ref[seq, off + p - 1 + j].exp() * ref[seq, off + p - 1 + j]).sum()
            assert ent[i, j].item() == pytest.approx(h.item(), abs=1e-5)
        assert lp[i, n:].eq(0).all()
    (lp * mb.loss_mask).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_planning():
    assert plan_micro_batches([3, 9, 5, 7], 2) == [[1, 3], [2, 0]]
    assert plan_micro_batches([3, 9, 5, 7], 2, max_tokens=12) == [[1, 0], [3, 2]]
    assert plan_micro_batches([20, 3], 8, max_tokens=10) == [[0], [1]]  # too long: a micro-batch of its own
    assert [list(r) for r in mini_batches(5, 2)] == [[0, 1, 2], [3, 4]]
    assert len(mini_batches(2, 4)) == 2


def test_bad_batches_are_refused():
    batch = make_batch(2)
    batch.advantages[1] = batch.advantages[1] + [0.0]
    with pytest.raises(ComponentError, match="advantages"):
        check_batch(batch)
    batch = make_batch(2)
    for s in batch.samples:
        s.loss_mask = [0] * len(s.loss_mask)
    with pytest.raises(ComponentError, match="no sample has a loss token"):
        check_batch(batch)
