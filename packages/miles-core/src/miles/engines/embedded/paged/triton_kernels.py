"""The two Triton kernels of the CUDA fast path: paged decode attention and plain sampling.

Both read everything they need (sequence lengths, block tables, temperatures, keys)
from device tensors, never from host values, so the launch arguments of a decode
step do not change between steps and a CUDA graph can replay them.

Why Triton rather than FlexAttention: a paged FlexAttention call needs a block mask
rebuilt from the block tables on every step (and recompiled per batch shape),
while this kernel walks the block table itself: one program per (row, KV head)
loads the query heads of its GQA group once and streams that row's keys and values
through an online softmax. Importing this module needs triton (on the GPU machine
it ships with torch); the CPU path never imports it. ``TRITON_INTERPRET=1`` runs the
kernels on the CPU for tests.
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]


@triton.jit
def _paged_decode_kernel(
    Q,
    K,
    V,
    Out,
    BT,
    ROWS,
    LENS,
    scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ob,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,  # "ieee" for float32 (exact tests), "tf32" (ignored for bf16 inputs)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(LENS + b)
    row = tl.load(ROWS + b).to(tl.int64)  # this request's row of the block-table tensor
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n
        nmask = pos < seq_len
        blk = tl.load(BT + row * stride_bt + pos // PAGE, mask=nmask, other=0)
        slot = blk.to(tl.int64) * PAGE + pos % PAGE
        kv_off = slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PREC)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(
        Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=gmask[:, None],
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page: int,
) -> torch.Tensor:
    """Attention of one query token per row over its paged KV.

    ``q`` [B, H, D]; ``k_cache``/``v_cache`` [slots, KVH, D] (one layer); ``block_tables``
    [R, max_blocks] int32, one row per request slot; ``rows`` [B] the block-table row of
    each query; ``seq_lens`` [B] (keys to attend, the new one included).
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        rows,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=dim,
        PAGE=page,
        BLOCK_N=64,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    return out


@triton.jit
def _mix32(x):
    # The hash of ``sampling.mix32`` in native uint32 arithmetic (products wrap mod 2**32).
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sample_split_kernel(
    L, TEMP, KEYS, M, S, BEST, BZ, BI, vocab, stride_l, span, SPLITS: tl.constexpr, MIN_T: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Program (row r, split j) reduces vocabulary entries [j * span, (j + 1) * span): the running
    # max and sum of exp for the log-softmax normaliser, and the best Gumbel score with its
    # token and scaled logit. sample_plain combines the splits.
    r = tl.program_id(0)
    j = tl.program_id(1)
    t = tl.load(TEMP + r)
    greedy = t < MIN_T
    t = tl.where(greedy, 1.0, t)
    key = tl.load(KEYS + r).to(tl.uint32)
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_z = tl.zeros([], tl.float32)
    best_i = tl.zeros([], tl.int32)
    lo = j * span
    hi = tl.minimum(lo + span, vocab)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        valid = idx < hi
        z = tl.load(L + r * stride_l + idx, mask=valid, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.where(valid, tl.exp(z - m_new), 0.0), 0)
        m = m_new
        h = _mix32(key ^ idx.to(tl.uint32))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(greedy, z, z - tl.log(-tl.log(u)))
        score = tl.where(valid, score, float("-inf"))
        tile_best = tl.max(score, 0)
        tile_arg = tl.argmax(score, 0)
        tile_z = tl.sum(tl.where(offs == tile_arg, z, 0.0), 0)
        take = tile_best > best  # strict: the first maximum wins, as torch.argmax
        best_i = tl.where(take, start + tile_arg, best_i)
        best_z = tl.where(take, tile_z, best_z)
        best = tl.where(take, tile_best, best)
    out = r * SPLITS + j
    tl.store(M + out, m)
    tl.store(S + out, s)
    tl.store(BEST + out, best)
    tl.store(BZ + out, best_z)
    tl.store(BI + out, best_i)


def sample_plain(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> tuple[Any, Any]:
    """Tokens and log-probs of rows without top-k/top-p: one pass over the logits, the vocabulary
    split over ``SPLITS`` programs per row (a batch of one still fills the GPU), then a few
    torch ops over ``[B, SPLITS]`` to combine (capturable, like the kernel)."""
    from miles.engines.embedded.paged.sampling import MIN_TEMPERATURE

    batch, vocab = logits.shape
    splits = 32
    block = 1024
    span = -(-vocab // (splits * block)) * block
    dev = logits.device
    m = torch.empty(batch, splits, dtype=torch.float32, device=dev)
    s, best, best_z = torch.empty_like(m), torch.empty_like(m), torch.empty_like(m)
    best_i = torch.empty(batch, splits, dtype=torch.int32, device=dev)
    _sample_split_kernel[(batch, splits)](
        logits, temperature, keys, m, s, best, best_z, best_i, vocab, logits.stride(0), span,
        SPLITS=splits, MIN_T=MIN_TEMPERATURE, BLOCK=block, num_warps=4,
    )  # fmt: skip
    top = m.max(dim=1, keepdim=True).values
    lse = top.squeeze(1) + torch.log((s * torch.exp(m - top)).sum(dim=1))
    # Splits are in vocabulary order, so argmax's first maximum is the first maximum overall.
    pick = best.argmax(dim=1, keepdim=True)
    tokens = best_i.gather(1, pick).squeeze(1).to(torch.int64)
    return tokens, best_z.gather(1, pick).squeeze(1) - lse


# ------------------------------------------------------------------ fused layer pieces
#
# A decode step of a 28-layer model is some 1,400 small kernels when every torch op runs on
# its own (each RMSNorm is six, RoPE a dozen), and at small batches their fixed cost, not
# the bytes, sets the step time. These kernels fold each group into one launch; they read
# the HF modules' own weight tensors and follow the HF numerics (the residual sum and the
# normalised value rounded to the model's dtype before the weight multiplies).


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Y, stride_x, stride_r, stride_y, eps, D: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:  # the residual stream: X += R, rounded to its dtype as torch's add is
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(
            X.dtype.element_ty
        )
        tl.store(X + row * stride_x + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / D
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(
        Y + row * stride_y + offs,
        (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty),
        mask=mask,
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += residual`` in place (when given), then RMSNorm of ``x`` with ``weight``; ``x`` is [N, D]."""
    n, d = x.shape
    y = torch.empty_like(x)
    r = residual if residual is not None else x
    _add_rms_norm_kernel[(n,)](
        x, r, weight, y, x.stride(0), r.stride(0), y.stride(0), eps,
        D=d, BLOCK=triton.next_power_of_2(d), ADD=residual is not None, num_warps=4,
    )  # fmt: skip
    return y


@triton.jit
def _norm_rope_store_kernel(
    Q, K, V, QW, KW, COS, SIN, POS, SLOTS, QOUT, KC, VC, stride_q, stride_k, stride_v, stride_qo, stride_c, eps,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    # Program (token t, head j): heads 0..H-1 are queries (normed, rotated, written to QOUT),
    # H..H+KVH-1 keys (normed, rotated, written to the pool slot), the rest values (copied there).
    t = tl.program_id(0)
    j = tl.program_id(1)
    offs = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (offs + half) % D
    sign = tl.where(offs < half, -1.0, 1.0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    dt = QOUT.dtype.element_ty
    if j >= H + KVH:
        v = tl.load(V + t * stride_v + (j - H - KVH) * D + offs)
        tl.store(VC + slot * stride_c + (j - H - KVH) * D + offs, v)
    else:
        if j < H:
            base = Q + t * stride_q + j * D
            wbase = QW
        else:
            base = K + t * stride_k + (j - H) * D
            wbase = KW
        x = tl.load(base + offs).to(tl.float32)
        xp = tl.load(base + partner).to(tl.float32)
        if NORM:  # Qwen3's per-head RMSNorm before RoPE (q_norm / k_norm)
            r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
            w = tl.load(wbase + offs).to(tl.float32)
            wp = tl.load(wbase + partner).to(tl.float32)
            x = (w * (x * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (wp * (xp * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        pos = tl.load(POS + t)
        c = tl.load(COS + pos * D + offs).to(tl.float32)
        s = tl.load(SIN + pos * D + offs).to(tl.float32)
        out = (x * c + sign * xp * s).to(dt)
        if j < H:
            tl.store(QOUT + t * stride_qo + j * D + offs, out)
        else:
            tl.store(KC + slot * stride_c + (j - H) * D + offs, out)


def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """From the projections ``q`` [T, H D], ``k`` and ``v`` [T, KVH D]: the normed, rotated queries
    [T, H, D]; the normed, rotated keys and the values go into the pool at ``slots``.
    ``cos``/``sin`` are the [positions, D] tables."""
    tokens = q.shape[0]
    kv_heads, dim = k_cache.shape[1], k_cache.shape[2]
    heads = q.shape[1] // dim
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    norm = q_weight is not None
    _norm_rope_store_kernel[(tokens, heads + 2 * kv_heads)](
        q, k, v, q_weight if norm else q, k_weight if norm else q, cos, sin, positions, slots, q_out, k_cache,
        v_cache, q.stride(0), k.stride(0), v.stride(0), q_out.stride(0), k_cache.stride(0), eps,
        H=heads, KVH=kv_heads, D=dim, NORM=norm, num_warps=1,
    )  # fmt: skip
    return q_out


@triton.jit
def _silu_mul_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0)
    u = tl.load(U + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    # torch's silu rounds to the dtype, then the product rounds again
    act = (gf / (1.0 + tl.exp(-gf))).to(G.dtype.element_ty)
    tl.store(Y + offs, (act.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, y, n, BLOCK=1024, num_warps=4)
    return y
