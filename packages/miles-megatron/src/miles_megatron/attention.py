"""Core attention for megatron-core's local layer spec through torch's SDPA (``megatron.core_attention: sdpa``).

megatron-core's own local core attention (``DotProductAttention``) materialises the whole
``[batch, heads, seq, seq]`` score matrix, masks it and runs a softmax over it: at sequence 2,048
that is the step's largest tensor and many kernels. Without Transformer Engine (which cannot be
installed on our GPU machines) nothing better comes with megatron-core. torch's
``scaled_dot_product_attention`` takes the same query, key and value and, for a causal mask in
bf16 on a GPU, runs the flash kernel: no score matrix and a fused backward. On the CPU it is what
makes the model run at all (megatron's version allocates on CUDA: ``miles_megatron.cpu``).

:class:`SDPADotProductAttention` is put into the local spec's ``core_attention`` slot, the
extension point megatron gives for it; nothing of megatron-core is patched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import (  # type: ignore[import-untyped]
    DotProductAttention,
)


class SDPADotProductAttention(DotProductAttention):
    """megatron's local core attention computed by torch's SDPA on whatever device the inputs are.

    Same inputs and output as ``DotProductAttention``: query ``[sq, b, np, hn]``, key and value
    ``[sk, b, ng, hn]``, megatron's boolean mask (True: masked out; None: causal), context
    ``[sq, b, np * hn]``, with the scale megatron's constructor chose. On CUDA the inputs keep their
    dtype, so a bf16 causal batch takes the flash kernel (its softmax accumulates in float32); on the
    CPU they are computed in float32, as megatron's local path does (``attention_softmax_in_fp32``),
    which keeps CPU runs equal to the HF reference. Dropout is refused (megatron draws it from the
    CUDA RNG tracker, and the HF families here have none).
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if self.attention_dropout.p != 0.0:
            raise ValueError(
                f"megatron core_attention sdpa: attention dropout {self.attention_dropout.p} is not supported; "
                "allowed: 0"
            )
        if self.config.softmax_type != "vanilla":
            raise ValueError(
                f"megatron core_attention sdpa: softmax_type {self.config.softmax_type!r}; allowed: vanilla"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "megatron core_attention sdpa: packed sequences and attention biases are not supported"
            )
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if q.device.type == "cpu":
            q, k, v = q.float(), k.float(), v.float()
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if attention_mask is None:
            context = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
            )
        else:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale, enable_gqa=gqa
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        context = context.to(query.dtype).permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)
