"""``miles_varlen``: attention of a packed row within each sample, from its boundaries, no mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from miles.errors import ModelError
from miles_fsdp import attention
from miles_fsdp.config import FSDPOptions
from miles_fsdp.models import attention_backend


def _block_causal_reference(q, k, v, lengths):
    """SDPA over the whole row with the block-diagonal causal mask transformers would build."""
    total = sum(lengths)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(total)
    mask = ((seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])).to(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _qkv(lengths, heads=4, kv_heads=2, dim=8, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    make = lambda h: torch.randn(1, h, total, dim, generator=g).to(device, dtype).requires_grad_()  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def test_packed_rows_attend_within_each_sample_only_with_gradients():
    lengths = [5, 1, 9, 3]
    q, k, v = _qkv(lengths)
    out, weights = attention.varlen_attention(
        nn.Module(), q, k, v, None, scaling=None, **attention.segment_kwargs(lengths, "cpu")
    )
    assert weights is None and out.shape == (1, sum(lengths), 4, 8)
    ref = _block_causal_reference(q, k, v, lengths).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    # A token of the second sample must not see the first: change the first, the rest stays.
    q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
    k2[..., :5, :] += 1.0
    out2, _ = attention.varlen_attention(
        nn.Module(), q2, k2, v2, None, **attention.segment_kwargs(lengths, "cpu")
    )
    torch.testing.assert_close(out2[:, 5:], out[:, 5:].detach())
    assert not torch.allclose(out2[:, :5], out[:, :5].detach())


def test_without_boundaries_it_is_causal_attention_per_row():
    q, k, v = _qkv([6])
    out, _ = attention.varlen_attention(nn.Module(), q, k, v, None)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_refusals_name_what_it_cannot_do():
    q, k, v = _qkv([4])
    with pytest.raises(ModelError, match="no dropout"):
        attention.varlen_attention(nn.Module(), q, k, v, None, dropout=0.1)
    with pytest.raises(ModelError, match="sliding window"):
        attention.varlen_attention(nn.Module(), q, k, v, None, sliding_window=2)
    with pytest.raises(ModelError, match="not an attention mask"):
        attention.varlen_attention(nn.Module(), q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))

    class Opaque(nn.Module):  # a model that does not forward attention keyword arguments
        pass

    with pytest.raises(ModelError, match=r"fsdp\.attn_implementation"):
        attention.check_model(Opaque(), "policy")


def test_packed_runs_default_to_miles_varlen_and_an_explicit_backend_wins():
    assert attention_backend(FSDPOptions()) is None
    assert attention_backend(FSDPOptions(max_tokens_per_gpu=64)) == attention.NAME
    assert attention_backend(FSDPOptions(max_tokens_per_gpu=64, attn_implementation="sdpa")) == "sdpa"
    from transformers import AttentionInterface

    assert attention.NAME in AttentionInterface._global_mapping or attention.NAME in AttentionInterface()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_varlen_equals_the_masked_reference_on_gpu():
    lengths = [700, 1, 300, 1024, 23]
    q, k, v = _qkv(lengths, heads=16, kv_heads=8, dim=128, device="cuda", dtype=torch.bfloat16)
    kwargs = attention.segment_kwargs(lengths, "cuda")
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    assert attention._flash_varlen(*flat, kwargs["cu_seq_lens_q"], max(lengths), None) is not None
    out, _ = attention.varlen_attention(nn.Module(), q, k, v, None, **kwargs)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _block_causal_reference(qf, kf, vf, lengths).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (qf, kf, vf))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
