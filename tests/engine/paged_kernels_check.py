"""Run by test_paged.py in a subprocess with TRITON_INTERPRET=1: the Triton kernels of the paged path,
interpreted on the CPU, against torch references. Prints one line per check; exits non-zero on a mismatch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from miles.engines.embedded.paged import triton_kernels as tk
from miles.engines.embedded.paged.model import _rotate_half, gather_meta
from miles.engines.embedded.paged.sampling import SamplingTensors, row_keys, sample_torch


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{name}: {'ok' if ok else 'MISMATCH'} {detail}")
    if not ok:
        raise SystemExit(1)


def main() -> None:
    torch.manual_seed(0)
    # Paged decode: 3 rows, table rows out of order, lengths across block edges, GQA groups of 2.
    page, heads, kvh, dim = 4, 4, 2, 16
    lens = [5, 9, 1]
    blocks = [[1, 2], [3, 4, 5], [6]]
    k = torch.randn(10 * page, kvh, dim)
    v = torch.randn_like(k)
    q = torch.randn(3, heads, dim)
    table = torch.zeros(5, 4, dtype=torch.int32)
    rows = torch.tensor([4, 1, 2], dtype=torch.int32)
    for r, b in zip(rows.tolist(), blocks, strict=True):
        table[r, : len(b)] = torch.tensor(b, dtype=torch.int32)
    out = tk.paged_decode(q, k, v, table, rows, torch.tensor(lens, dtype=torch.int32), dim**-0.5, page)
    meta = gather_meta([1] * 3, lens, blocks, page, "cpu")
    kp = k[meta.kv_slots].transpose(1, 2).repeat_interleave(2, 1)
    vp = v[meta.kv_slots].transpose(1, 2).repeat_interleave(2, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kp, vp, attn_mask=meta.mask)[
        :, :, 0
    ]
    check("paged_decode", torch.allclose(out, ref, atol=1e-5), f"max err {(out - ref).abs().max():.2e}")

    # Sampling: the kernel draws what the torch sampler draws (same hash), greedy rows included.
    vocab = 5000
    logits = torch.randn(4, vocab) * 3
    st = SamplingTensors(
        temperature=torch.tensor([0.0, 1.0, 0.7, 1.3]),
        top_p=torch.ones(4),
        top_k=torch.full((4,), vocab),
        seeds=torch.tensor([1, 2, 3, -5]),
        positions=torch.tensor([10, 11, 12, 13]),
        filtered=False,
    )
    t1, l1 = sample_torch(logits, st)
    t2, l2 = tk.sample_plain(logits, st.temperature, row_keys(st.seeds, st.positions))
    check(
        "sample_plain",
        torch.equal(t1, t2) and torch.allclose(l1, l2, atol=1e-5),
        f"{t1.tolist()} {t2.tolist()}",
    )

    # Residual add + RMSNorm against the HF formula.
    x = torch.randn(3, 24)
    r = torch.randn(3, 24)
    w = torch.randn(24)
    x_ref = x + r
    y_ref = w * (x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + 1e-6))
    y = tk.add_rms_norm(x, r, w, 1e-6)
    check("add_rms_norm", torch.allclose(x, x_ref) and torch.allclose(y, y_ref, atol=1e-5))

    # q/k norm + RoPE + KV store.
    tokens, dim = 3, 8
    qx, kx, vx = (
        torch.randn(tokens, heads * dim),
        torch.randn(tokens, kvh * dim),
        torch.randn(tokens, kvh * dim),
    )
    qw, kw = torch.randn(dim), torch.randn(dim)
    cos, sin = torch.randn(16, dim), torch.randn(16, dim)
    pos = torch.tensor([0, 5, 9])
    slots = torch.tensor([7, 2, 11])
    kc, vc = torch.zeros(12, kvh, dim), torch.zeros(12, kvh, dim)
    qo = tk.norm_rope_store(qx, kx, vx, qw, kw, 1e-6, cos, sin, pos, slots, kc, vc)

    def norm_rope(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        t = weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))
        return t * cos[pos][:, None] + _rotate_half(t) * sin[pos][:, None]

    q_ref = norm_rope(qx.view(tokens, heads, dim), qw)
    k_ref = norm_rope(kx.view(tokens, kvh, dim), kw)
    ok = torch.allclose(qo, q_ref, atol=1e-5) and torch.allclose(kc[slots], k_ref, atol=1e-5)
    check("norm_rope_store", ok and torch.equal(vc[slots], vx.view(tokens, kvh, dim)))

    g, u = torch.randn(5, 40), torch.randn(5, 40)
    check("silu_mul", torch.allclose(tk.silu_mul(g, u), torch.nn.functional.silu(g) * u, atol=1e-6))


if __name__ == "__main__":
    main()
