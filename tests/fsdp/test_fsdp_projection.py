"""Log-probs from hidden states (``fsdp.logprob_projection: chunked``) equal the plain computation."""

from __future__ import annotations

import pytest
import torch

from fsdp.helpers import hf_token_logprobs, make_batch, make_spec
from miles.errors import ModelError
from miles.train_rows import OLD_LOGPROBS
from miles_fsdp.logprobs import projected_token_logprobs, token_logprobs


def _plain(hidden, weight, bias, targets, temperature):
    """The reference: full logits, float32 log-softmax at the temperature, as the engine samples."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


def _trainer_full(hidden, weight, bias, targets, temperature):
    """What the trainer computes with full logits: the head's output, then ``token_logprobs``."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    rows = torch.arange(hidden.shape[0])
    return token_logprobs(logits, rows, targets, temperature=temperature, chunk=4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_projected_logprobs_and_gradients_equal_full_logits(temperature, with_bias):
    torch.manual_seed(0)
    n, h, v = 13, 16, 50
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (0.3 * torch.randn(v, h)).requires_grad_()
    bias = torch.randn(v, requires_grad=True) if with_bias else None
    targets = torch.randint(0, v, (n,))
    g_lp, g_ent = torch.randn(n, dtype=torch.float32), torch.randn(n, dtype=torch.float32)

    lp, ent = projected_token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, chunk=4)
    (lp * g_lp + ent * g_ent).sum().backward()
    got = [hidden.grad, weight.grad] + ([bias.grad] if bias is not None else [])
    for t in [hidden, weight] + ([bias] if bias is not None else []):
        t.grad = None
    ref_lp, ref_ent = _trainer_full(hidden, weight, bias, targets, temperature)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()
    want = [hidden.grad, weight.grad] + ([bias.grad] if bias is not None else [])
    # The same arithmetic as the full-logits path, chunk for chunk: equal to float32 rounding.
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # And both are the log-softmax at the temperature, as the engine computes it.
    with torch.no_grad():
        soft_lp, soft_ent = _plain(hidden, weight, bias, targets, temperature)
    torch.testing.assert_close(lp, soft_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, soft_ent, atol=1e-5, rtol=1e-4)


def test_projected_logprobs_only_the_used_output_gets_work():
    """A loss reading the log-probs alone: the entropy branch gives no gradient, and vice versa."""
    torch.manual_seed(1)
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    targets = torch.randint(0, 20, (6,))
    lp, _ = projected_token_logprobs(hidden, weight, targets, chunk=5)
    lp.sum().backward()
    ref_lp, _ = _plain(hidden.detach().requires_grad_(), weight, None, targets, 1.0)
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    torch.testing.assert_close(lp, ref_lp)


def test_chunked_backend_trains_like_the_full_logits_backend(tiny_model, backend_factory):
    batch = make_batch(5, seed=31)
    probe = make_batch(4, seed=32).samples
    out = {}
    for projection in ("full", "chunked"):
        backend = backend_factory(
            make_spec(
                tiny_model,
                1,
                temperature=0.7,
                fsdp={"logprob_projection": projection, "logprob_chunk_tokens": 3},
            )
        )
        before = backend.score(probe, [OLD_LOGPROBS])[OLD_LOGPROBS]
        metrics = [backend.train_step(batch) for _ in range(2)]
        after = backend.score(probe, [OLD_LOGPROBS])[OLD_LOGPROBS]
        backend.shutdown()
        out[projection] = (before, metrics, after)
    (b_full, m_full, a_full), (b_chunk, m_chunk, a_chunk) = out["full"], out["chunked"]
    want = hf_token_logprobs(tiny_model, make_batch(4, seed=32), 0.7)
    for got, ref in zip(b_chunk, want, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=1e-5, rtol=0)
    for a, b in zip(m_full, m_chunk, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/entropy", "loss/mean_logprob"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for a, b in zip(a_full, a_chunk, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    moved = [abs(x - y) for ra, rb in zip(b_full, a_full, strict=True) for x, y in zip(ra, rb, strict=True)]
    assert max(moved) > 1e-4  # the two steps changed the policy


def test_a_head_the_chunked_path_cannot_reproduce_is_refused():
    from torch import nn

    from miles_fsdp.models import check_projectable

    class Capped(nn.Module):
        config = type("C", (), {"final_logit_softcapping": 30.0})()

        def get_output_embeddings(self):
            return nn.Linear(2, 3)

    with pytest.raises(ModelError, match="softcaps"):
        check_projectable(Capped(), "teacher")

    class NoLinear(nn.Module):
        def get_output_embeddings(self):
            return nn.Identity()

    with pytest.raises(ModelError, match="not a Linear"):
        check_projectable(NoLinear(), "policy")
