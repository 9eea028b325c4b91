"""Packed training (``fsdp.max_tokens_per_gpu``): token-budget micro-batches, no padding, exact."""

from __future__ import annotations

import pytest
import torch

from fsdp.helpers import dumped_logprobs, hf_token_logprobs, make_batch, make_spec
from miles.train_rows import OLD_LOGPROBS, sample_row
from miles_fsdp.batching import collate, plan_tokens


def test_plan_tokens_respects_the_budget_balances_ranks_and_places_every_sample_once():
    lengths = [9, 3, 7, 7, 2, 11, 5, 4, 30]
    layout = plan_tokens(lengths, world_size=2, max_tokens=16)
    assert len({len(r) for r in layout}) == 1  # every rank runs the same number of passes
    assert sorted(i for r in layout for mb in r for i in mb) == list(range(len(lengths)))
    for r in layout:
        for mb in r:
            assert sum(lengths[i] for i in mb) <= 16 or len(mb) == 1  # only a lone long sample exceeds it
    loads = [sum(lengths[i] for mb in r for i in mb) for r in layout]
    assert abs(loads[0] - loads[1]) <= max(lengths)
    assert plan_tokens([4], world_size=2, max_tokens=8) == [[[0]], [[]]]


def test_packed_collate_puts_samples_end_to_end_with_their_own_positions():
    batch = make_batch(3, seed=41)
    rows = [sample_row(s, a) for s, a in zip(batch.samples, batch.advantages, strict=True)]
    mb = collate(rows, "cpu", packed=True)
    total = sum(r.num_tokens for r in rows)
    assert mb.input_ids.shape == (1, total) and mb.position_ids is not None
    flat = mb.input_ids.reshape(-1)
    # Each logits row predicts the next token of its own sample: the target sits right after it.
    assert torch.equal(flat[mb.rows + 1], mb.targets)
    starts = (mb.position_ids[0] == 0).nonzero().reshape(-1).tolist()
    assert starts == [0, rows[0].num_tokens, rows[0].num_tokens + rows[1].num_tokens]
    padded = collate(rows, "cpu")
    assert torch.equal(mb.targets, padded.targets) and torch.equal(mb.slots, padded.slots)
    assert torch.equal(mb.loss_mask, padded.loss_mask)


@pytest.mark.parametrize("projection", ["full", "chunked"])
def test_packed_training_equals_padded_training(tiny_model, backend_factory, tmp_path, projection):
    batch = make_batch(7, seed=42)
    probe = make_batch(4, seed=43).samples
    runs = {}
    for packed in (False, True):
        dump = tmp_path / f"dump-{packed}"
        dump.mkdir()
        fsdp = {"logprob_projection": projection, **({"max_tokens_per_gpu": 20} if packed else {})}
        backend = backend_factory(
            make_spec(tiny_model, 1, temperature=0.9, loss_options={"dump_dir": str(dump)}, fsdp=fsdp)
        )
        metrics = [backend.train_step(batch)]
        first = dumped_logprobs(str(dump))
        metrics.append(backend.train_step(batch))
        after = backend.score(probe, [OLD_LOGPROBS])[OLD_LOGPROBS]
        backend.shutdown()
        runs[packed] = (metrics, first, after)
    (m_pad, lp_pad, after_pad), (m_pack, lp_pack, after_pack) = runs[False], runs[True]
    # The packed log-probs are each sample's own forward: no attention across the samples packed with it.
    want = hf_token_logprobs(tiny_model, batch, 0.9)
    for i, ref in enumerate(want):
        torch.testing.assert_close(torch.tensor(lp_pack[i]), torch.tensor(ref), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(lp_pack[i]), torch.tensor(lp_pad[i]), atol=1e-5, rtol=0)
    for a, b in zip(m_pad, m_pack, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/entropy", "loss/mean_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
        assert a["train/num_tokens"] == b["train/num_tokens"]
    for a, b in zip(after_pad, after_pack, strict=True):  # the same updates, so the same policy after
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
