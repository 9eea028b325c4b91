"""Sampling on the device: temperature, top-k, top-p, per-request seeds, log-probs in the same step.

Randomness is counter-based: the Gumbel noise of token ``v`` when sampling the token
at sequence position ``p`` of a request with seed ``s`` is a pure function of
``(s, p, v)`` (an integer hash). Nothing carries state from one step to the next,
so a step can be replayed by a CUDA graph, and a request that is retracted and
prefilled again draws the very same tokens. Sampling is the Gumbel-max trick:
``argmax(log p + g)`` with ``g = -log(-log(u))`` draws from ``p``.

Log-probs are the engine's usual ones (see ``sampler``): ``log_softmax(logits / T)``
over the full vocabulary, before top-k/top-p truncation; greedy rows (``T`` below
``MIN_TEMPERATURE``) take ``argmax(logits)`` and report ``log_softmax(logits)``.

The hash uses 32-bit arithmetic carried in int64 (masked after every product), so
torch on any device and the Triton kernel compute the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B


def mix32(x: Any) -> Any:
    """An avalanche hash of 32-bit values held in an int64 tensor (or a Python int)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def row_keys(seeds: Any, positions: Any) -> Any:
    """One 32-bit key per row from its seed (int64) and the position of the token it samples."""
    return mix32(mix32(seeds & MASK32) ^ mix32((seeds >> 32) & MASK32) ^ (positions & MASK32))


def uniforms(keys: Any, vocab: int) -> Any:
    """``[B, V]`` float32 in (0, 1) from row keys ``[B]``."""
    import torch

    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = mix32(keys[:, None] ^ idx[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device; a greedy row has temperature 0."""

    temperature: Any  # [B] float32
    top_p: Any  # [B] float32
    top_k: Any  # [B] int64, the vocabulary size when disabled
    seeds: Any  # [B] int64
    positions: Any  # [B] int64: the sequence position of the token being sampled
    filtered: bool  # whether any row has top-k or top-p (the slower, sorting path)


MIN_TEMPERATURE = 1e-5


def sample_torch(logits: Any, st: SamplingTensors) -> tuple[Any, Any]:
    """Tokens ``[B]`` (int64) and their log-probs ``[B]`` (float32), with torch ops only."""
    import torch
    from torch.nn import functional as F

    logits = logits.float()
    greedy = st.temperature < MIN_TEMPERATURE
    temps = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    logp = F.log_softmax(logits / temps[:, None], dim=-1)
    score = logp
    if st.filtered:
        score = _filter(logp, st.top_k, st.top_p)
    noisy = score - torch.log(-torch.log(uniforms(row_keys(st.seeds, st.positions), logits.shape[-1])))
    tokens = torch.where(greedy, logits.argmax(dim=-1), noisy.argmax(dim=-1))
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _filter(logp: Any, top_k: Any, top_p: Any) -> Any:
    """``logp`` with the tokens outside each row's top-k, then outside its top-p mass, at -inf
    (the rule of the DynamicCache path: top-p counts the unrenormalised top-k mass)."""
    import torch

    vocab = logp.shape[-1]
    sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
    k = top_k.clamp(1, vocab)
    kth = sorted_lp.gather(1, (k - 1)[:, None])
    sorted_f = sorted_lp.masked_fill(sorted_lp < kth, float("-inf"))
    probs = sorted_f.exp()
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False  # the top token always stays
    sorted_f = sorted_f.masked_fill(drop, float("-inf"))
    return torch.full_like(logp, float("-inf")).scatter(1, order, sorted_f)


def sample(logits: Any, st: SamplingTensors) -> tuple[Any, Any]:
    """The device's sampler: the Triton kernel on CUDA for unfiltered batches, torch otherwise."""
    if logits.device.type == "cuda" and not st.filtered:
        from miles.engines.embedded.paged.triton_kernels import sample_plain

        return sample_plain(logits, st.temperature, row_keys(st.seeds, st.positions))
    return sample_torch(logits, st)
