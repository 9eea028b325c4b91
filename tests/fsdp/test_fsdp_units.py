"""Unit tests of the FSDP backend's pure parts: batch planning, padding, log-probs, options."""

from __future__ import annotations

import pytest
import torch

from fsdp.helpers import make_batch
from miles.errors import ComponentError
from miles.train_rows import check_batch
from miles_fsdp.batching import collate, plan, split_batch
from miles_fsdp.logprobs import token_logprobs


def test_plan_equal_micro_batch_counts_and_every_sample_once():
    lengths = [5, 9, 3, 7, 7, 2, 11]
    layout = plan(lengths, world_size=3, micro_batch_size=2)
    assert len({len(r) for r in layout}) == 1  # every rank runs the same number of passes
    flat = sorted(i for r in layout for mb in r for i in mb)
    assert flat == list(range(len(lengths)))
    assert all(len(mb) <= 2 for r in layout for mb in r)


def test_plan_more_ranks_than_samples_gives_empty_micro_batches():
    layout = plan([4], world_size=2, micro_batch_size=8)
    assert layout == [[[0]], [[]]]


def test_split_batch_carries_global_token_count():
    batch = make_batch(5)
    shares = split_batch(batch, 2, 2)
    assert all(s.num_loss_tokens == batch.num_loss_tokens for s in shares)
    assert sum(len(mb) for s in shares for mb in s.micro_batches) == 5


def test_collate_aligns_response_tokens_with_predicting_logits():
    batch = make_batch(3)
    rows = split_batch(batch, 1, 8)[0].micro_batches[0]
    mb = collate(rows, "cpu")
    b = mb.input_ids.shape[0]
    resp_len = mb.loss_mask.shape[1]
    flat_ids = mb.input_ids.reshape(-1)
    # The token after each predicting position is the target it predicts.
    assert torch.equal(flat_ids[mb.rows + 1], mb.targets)
    for i, r in enumerate(rows):
        n = len(r.response_ids)
        assert mb.loss_mask[i, :n].tolist() == [float(x) for x in r.loss_mask]
        assert mb.loss_mask[i, n:].sum() == 0
    assert mb.slots.max() < b * resp_len
    assert mb.num_loss_tokens == sum(sum(r.loss_mask) for r in rows)


def test_check_batch_rejects_misaligned_sample():
    batch = make_batch(2)
    batch.samples[1].loss_mask = batch.samples[1].loss_mask[:-1]
    with pytest.raises(ComponentError, match=r"sample 1.*loss_mask"):
        check_batch(batch)


def test_check_batch_rejects_wrong_advantage_length():
    batch = make_batch(2)
    batch.advantages[0] = batch.advantages[0] + [1.0]
    with pytest.raises(ComponentError, match="advantages for"):
        check_batch(batch)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_matches_log_softmax_and_its_gradient(temperature):
    torch.manual_seed(0)
    logits = torch.randn(10, 17, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([0, 2, 3, 8, 9])
    targets = torch.tensor([1, 16, 0, 5, 5])
    lp, ent = token_logprobs(logits, rows, targets, temperature=temperature, chunk=2)
    ref_all = torch.log_softmax(logits / temperature, dim=-1)[rows]
    ref = ref_all.gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(lp.double(), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent.double(), -(ref_all.exp() * ref_all).sum(-1), atol=1e-6, rtol=0)
    w = torch.randn(5, dtype=torch.float64)
    (grad,) = torch.autograd.grad((lp * w).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_entropy_gradient_matches_autograd(temperature):
    """The entropy bonus needs dH/dlogits: alone, and mixed with the log-prob gradient."""
    torch.manual_seed(1)
    logits = torch.randn(8, 13, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([1, 2, 6, 7])
    targets = torch.tensor([3, 0, 12, 3])
    ref_all = torch.log_softmax(logits / temperature, dim=-1)[rows]
    ref_lp = ref_all.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    w, v = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    for objective in (lambda lp, ent: (ent * v).sum(), lambda lp, ent: (lp * w + ent * v).sum()):
        lp, ent = token_logprobs(logits, rows, targets, temperature=temperature, chunk=3)
        (grad,) = torch.autograd.grad(objective(lp, ent), logits)
        (ref_grad,) = torch.autograd.grad(objective(ref_lp, ref_ent), logits, retain_graph=True)
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


def test_token_logprobs_bfloat16_logits_are_read_in_float32():
    torch.manual_seed(0)
    logits = torch.randn(4, 9).to(torch.bfloat16)
    lp, _ = token_logprobs(logits, torch.arange(4), torch.tensor([0, 1, 2, 3]))
    ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor([[0], [1], [2], [3]])).squeeze(1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref)


def test_fsdp_section_is_contributed_through_the_hook():
    from miles_fsdp.config import FSDPOptions
    from miles_fsdp.hooks import miles_config_sections

    (section,) = miles_config_sections()
    assert section.name == "fsdp" and section.model is FSDPOptions
    with pytest.raises(ValueError, match="num_rank"):
        FSDPOptions.model_validate({"num_rank": 2})


def test_broadcast_with_engine_on_a_trainer_gpu_is_refused_before_start():
    from miles.config import load_recipe
    from miles.errors import ConfigError
    from miles_fsdp.hooks import miles_configure

    clash = load_recipe("default", ["fsdp.device=cuda", "engine.device=cuda", "transport=broadcast"])
    with pytest.raises(ConfigError, match=r"engine\.device=cuda:1"):
        miles_configure(clash)
    miles_configure(load_recipe("default", ["fsdp.device=cuda", "engine.device=cuda:1"]))
    miles_configure(load_recipe("default", ["fsdp.device=cuda", "engine.device=cuda", "transport=colocated"]))
