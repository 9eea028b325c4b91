"""A Qwen2/Qwen3 dense forward pass over the paged KV pool, on the HF model's own modules.

Every weight is read through the Hugging Face model's modules (``q_proj``, norms,
``mlp``, ``lm_head``...), never copied, so a weight update that writes into the
model's parameters in place (every receiver does: ``WeightUpdater.apply`` copies
into them) is what the next step computes with, captured CUDA graphs included.

Tokens of one step are flat (``[T, hidden]``): prefill chunks of several requests
and decode tokens are laid end to end, each with its position and the pool slot its
key and value are written to. Attention has two forms:

- ``gather``: each sequence's keys and values are gathered from the pool into a
  padded batch and fed to ``scaled_dot_product_attention`` with an explicit mask
  (causal inside the chunk, everything before it). Used for prefill chunks
  everywhere, and for decode on the CPU. Plain torch.
- ``paged``: one query token per row, the Triton kernel walking the block table
  (see ``triton_kernels``). Used for decode on CUDA; it is what the CUDA graphs replay.

On CUDA the rest of a layer runs through fused Triton kernels (``_forward_fused``:
residual add + RMSNorm, q/k norm + RoPE + KV store, SiLU x up) on the same weight
tensors; on the CPU through the HF modules' own forwards (``_forward_modules``).

Qwen3-MoE's sparse layers run their MLP through ``moe`` (the HF block's modules on the
CPU, a forward without host synchronisation on CUDA) and write the experts each token was
routed to into the step's routing buffer (``PagedModel.routed``), for routing replay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("miles.engines.embedded")

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` cannot run on the paged path (None: it can)."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        return f"{name} is not one of the paged path's models ({', '.join(SUPPORTED_ARCHITECTURES)})"
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        return f"{name} has sliding-window layers, which the paged path does not implement"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
        return "dynamic RoPE scaling changes with the sequence length; the paged path uses a fixed table"
    if name == "Qwen3MoeForCausalLM":
        from miles.engines.embedded.paged.moe import moe_reason

        return moe_reason(list(model.model.layers))
    return None


def cuda_kernel_reason(model: Any) -> str | None:
    """Why the CUDA kernels cannot run ``model``'s attention (None: they can).

    The decode kernel multiplies [queries, head_dim] tiles with ``tl.dot``, which needs every
    dimension >= 16, and indexes the head with ``tl.arange``, which needs a power of two."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16 (the paged decode kernel needs one on CUDA)"
    return None


@dataclass
class GatherMeta:
    """Padded attention layout of the sequences of one step (the ``gather`` form)."""

    kv_slots: Any  # [P, Lk] long: pool slot of each key (0, the scratch slot, past a sequence's end)
    q_index: Any  # [P, Lq] long: index into the step's flat tokens (0 where padded)
    q_valid: Any  # [P, Lq] bool
    mask: Any  # [P, 1, Lq, Lk] bool: True where a query may attend a key


@dataclass
class PagedMeta:
    """The ``paged`` form: one query per row."""

    block_tables: Any  # [R, max_blocks] int32 on the device
    rows: Any  # [B] int32
    seq_lens: Any  # [B] int32


@dataclass
class StepInputs:
    input_ids: Any  # [T] long
    positions: Any  # [T] long
    slots: Any  # [T] long: where each token's key and value go
    logit_rows: Any  # [S] long: the tokens whose logits are wanted (None: every token)
    attn: GatherMeta | PagedMeta
    # MoE models: [sparse layers, T, top_k] long, where each sparse layer writes the experts it
    # routed each token to (None: the forward allocates one).
    routed: Any = None


def gather_meta(
    q_lens: list[int], kv_lens: list[int], block_lists: list[list[int]], block_size: int, device: Any
) -> GatherMeta:
    """Layout of sequences that feed ``q_lens[i]`` new tokens ending at ``kv_lens[i]`` keys."""
    import torch

    n = len(q_lens)
    lq, lk = max(q_lens), max(kv_lens)
    kv_slots = torch.zeros(n, lk, dtype=torch.long)
    q_index = torch.zeros(n, lq, dtype=torch.long)
    q_valid = torch.zeros(n, lq, dtype=torch.bool)
    q_pos = torch.full((n, lq), -1, dtype=torch.long)
    kv_len_t = torch.tensor(kv_lens, dtype=torch.long)
    offset = 0
    for i, (ql, kl, blocks) in enumerate(zip(q_lens, kv_lens, block_lists, strict=True)):
        pos = torch.arange(kl)
        table = torch.tensor(blocks, dtype=torch.long)
        kv_slots[i, :kl] = table[pos // block_size] * block_size + pos % block_size
        q_index[i, :ql] = torch.arange(offset, offset + ql)
        q_valid[i, :ql] = True
        q_pos[i, :ql] = torch.arange(kl - ql, kl)
        offset += ql
    keys = torch.arange(lk)
    mask = (keys[None, None, :] <= q_pos[:, :, None]) & (keys[None, None, :] < kv_len_t[:, None, None])
    # A padded query row must attend something, or its softmax is NaN (it is dropped afterwards).
    mask[:, :, 0] |= ~q_valid
    return GatherMeta(
        kv_slots=kv_slots.to(device),
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        mask=mask[:, None].to(device),
    )


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedModel:
    def __init__(self, model: Any, pool: Any, block_size: int, max_positions: int) -> None:
        import torch

        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = model.lm_head
        config = model.config
        self.num_heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.scale = float(self.layers[0].self_attn.scaling)
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.pool = pool
        self.block_size = block_size
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        # cos/sin of every position, from the model's own rotary module (whatever its RoPE
        # scaling), in the model's dtype as the HF attention applies them.
        cos_parts, sin_parts = [], []
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            for start in range(0, max_positions, 8192):
                pos = torch.arange(start, min(start + 8192, max_positions), device=self.device)[None]
                cos, sin = inner.rotary_emb(probe, pos)
                cos_parts.append(cos[0])
                sin_parts.append(sin[0])
        self.cos = torch.cat(cos_parts).contiguous()
        self.sin = torch.cat(sin_parts).contiguous()
        self.max_positions = max_positions
        # On CUDA the layers run through the fused Triton kernels (few launches per layer);
        # elsewhere, and for activations other than SiLU, through the HF modules' own forwards.
        self.fused = self.device.type == "cuda" and getattr(config, "hidden_act", "silu") == "silu"
        self._init_moe()

    def _init_moe(self) -> None:
        """Which layers are sparse (Qwen3-MoE), and how their experts run on this device."""
        import torch

        from miles.engines.embedded.paged.moe import grouped_mm_reason, is_sparse

        # Per layer: its index among the sparse layers (the routing buffer's first axis, in the
        # order RoutingRecorder reports), -1 for a dense MLP.
        self.sparse: list[int] = []
        self.num_sparse = 0
        for layer in self.layers:
            self.sparse.append(self.num_sparse if is_sparse(layer.mlp) else -1)
            self.num_sparse += is_sparse(layer.mlp)
        self.routed: Any = None  # the last step's routing buffer (MoE models only)
        self.grouped = False
        # Why decode steps cannot be captured in CUDA graphs (None: they can).
        self.graph_reason: str | None = None
        if not self.num_sparse:
            return
        first = next(layer.mlp for layer, j in zip(self.layers, self.sparse, strict=True) if j >= 0)
        self.top_k = int(first.gate.top_k)
        num_experts, hidden, inter = (int(d) for d in first.experts.down_proj.shape)
        self.expert_range = torch.arange(num_experts, device=self.device)
        how = "the HF block's modules"
        if self.device.type == "cuda" and not self.fused:
            # The HF experts may read group sizes on the host, which a graph capture forbids.
            self.graph_reason = "the sparse blocks run through the HF modules (an activation other than SiLU)"
        if self.fused:
            reason = grouped_mm_reason(self.dtype, self.device, hidden, inter)
            self.grouped = reason is None
            how = (
                "grouped GEMMs (torch grouped_mm, no host synchronisation)"
                if reason is None
                else f"the HF experts eagerly and every expert densely inside CUDA graphs ({reason})"
            )
        log.info(
            "MoE: %d of %d layers sparse, %d experts, top %d; experts run by %s",
            self.num_sparse,
            len(self.layers),
            num_experts,
            self.top_k,
            how,
        )

    def forward(self, step: StepInputs) -> Any:
        """Logits (float32) of ``step.logit_rows``; writes every token's KV into the pool (and,
        for an MoE model, every token's experts into ``step.routed``, kept as ``self.routed``)."""
        if self.num_sparse:
            if step.routed is None:
                import torch

                tokens = step.input_ids.shape[0]
                step.routed = torch.empty(
                    self.num_sparse, tokens, self.top_k, dtype=torch.long, device=self.device
                )
            self.routed = step.routed
        return self._forward_fused(step) if self.fused else self._forward_modules(step)

    def _forward_fused(self, step: StepInputs) -> Any:
        from miles.engines.embedded.paged.moe import moe_fused
        from miles.engines.embedded.paged.triton_kernels import add_rms_norm, norm_rope_store, silu_mul

        x = self.embed(step.input_ids)
        tokens = x.shape[0]
        k_pool, v_pool = self.pool.k, self.pool.v
        first = self.layers[0].input_layernorm
        h = add_rms_norm(x, None, first.weight, first.variance_epsilon)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            qn = attn.q_norm if self.qk_norm else None
            q = norm_rope_store(
                attn.q_proj(h),
                attn.k_proj(h),
                attn.v_proj(h),
                qn.weight if qn is not None else None,
                attn.k_norm.weight if qn is not None else None,
                qn.variance_epsilon if qn is not None else 0.0,
                self.cos,
                self.sin,
                step.positions,
                step.slots,
                k_pool[i],
                v_pool[i],
            )
            o = self._attend(q, k_pool[i], v_pool[i], step.attn)
            post = layer.post_attention_layernorm
            h = add_rms_norm(x, attn.o_proj(o.reshape(tokens, -1)), post.weight, post.variance_epsilon)
            mlp = layer.mlp
            if self.sparse[i] < 0:
                m = mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
            else:
                m = moe_fused(mlp, h, step.routed[self.sparse[i]], self.grouped, self.expert_range)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h = add_rms_norm(x, m, nxt.weight, nxt.variance_epsilon)
        h = h if step.logit_rows is None else h[step.logit_rows]
        return self.lm_head(h).float()

    def _forward_modules(self, step: StepInputs) -> Any:
        from miles.engines.embedded.paged.moe import moe_modules

        x = self.embed(step.input_ids)
        tokens = x.shape[0]
        cos = self.cos[step.positions][:, None, :]
        sin = self.sin[step.positions][:, None, :]
        k_pool, v_pool = self.pool.k, self.pool.v
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(tokens, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(tokens, self.kv_heads, self.head_dim)
            if self.qk_norm:
                q = attn.q_norm(q)
                k = attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_pool[i].index_copy_(0, step.slots, k)
            v_pool[i].index_copy_(0, step.slots, v)
            o = self._attend(q, k_pool[i], v_pool[i], step.attn)
            x = x + attn.o_proj(o.reshape(tokens, self.num_heads * self.head_dim))
            h = layer.post_attention_layernorm(x)
            if self.sparse[i] < 0:
                x = x + layer.mlp(h)
            else:
                x = x + moe_modules(layer.mlp, h, step.routed[self.sparse[i]])
        x = self.norm(x if step.logit_rows is None else x[step.logit_rows])
        return self.lm_head(x).float()

    def _attend(self, q: Any, k_cache: Any, v_cache: Any, meta: GatherMeta | PagedMeta) -> Any:
        if isinstance(meta, PagedMeta):
            from miles.engines.embedded.paged.triton_kernels import paged_decode

            return paged_decode(
                q, k_cache, v_cache, meta.block_tables, meta.rows, meta.seq_lens, self.scale, self.block_size
            )
        from torch.nn import functional as F

        qp = q[meta.q_index].transpose(1, 2)  # [P, H, Lq, D]
        kp = k_cache[meta.kv_slots].transpose(1, 2)  # [P, KVH, Lk, D]
        vp = v_cache[meta.kv_slots].transpose(1, 2)
        groups = self.num_heads // self.kv_heads
        if groups > 1:
            kp = kp.repeat_interleave(groups, dim=1)
            vp = vp.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask, scale=self.scale)
        return out.transpose(1, 2)[meta.q_valid]  # [T, H, D], in the flat token order
