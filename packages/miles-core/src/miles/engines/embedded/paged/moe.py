"""Qwen3-MoE's sparse MLP on the paged path, over the HF modules' own weight tensors.

In transformers 5.x a sparse layer of ``Qwen3MoeForCausalLM`` holds
``mlp = Qwen3MoeSparseMoeBlock``, whose forward runs two modules on the flattened tokens:

- ``mlp.gate`` (``Qwen3MoeTopKRouter``, weight ``[E, hidden]``): logits, softmax in
  float32, top-k, divided by their sum when ``norm_topk_prob``, cast back to the model dtype;
- ``mlp.experts`` (``Qwen3MoeExperts``): ``gate_up_proj [E, 2 * inter, hidden]`` (gate
  rows first) and ``down_proj [E, hidden, inter]``, fused 3-D parameters; its forward is
  dispatched by ``config._experts_implementation`` (``grouped_mm`` by default).

Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid hold a dense MLP, run
like Qwen3's. Nothing here copies a weight: a weight update that writes into the parameters
in place is what the next step (or graph replay) computes with.

Three ways to run a sparse block, all recording the chosen experts of every token into a
``[tokens, top_k]`` int64 slice of the step's routing buffer:

- :func:`moe_modules` (the CPU path): the block's own router and experts modules, so the
  numbers are the HF block's, bit for bit.
- :func:`experts_grouped` (CUDA, bfloat16 on Hopper/Blackwell): (token, expert) pairs sorted
  by expert, group ends found on the device with ``searchsorted``, two
  ``torch.nn.functional.grouped_mm`` calls. No host synchronisation, so a decode graph
  captures it; the same kernel the HF experts' ``grouped_mm`` path uses.
- :func:`experts_dense` (CUDA, while a decode graph is captured, when grouped GEMMs cannot
  run: float32, float16, older GPUs): every expert on every token of the step, weighted by
  the routing weight (zero for the experts not chosen). Shapes never depend on the routing,
  so it needs no host synchronisation; it costs ``E / top_k`` times the FLOPs of the routed
  computation, acceptable for the small batches of a decode step in a test dtype. Eager
  steps in those dtypes call the HF experts module instead (it may synchronise; outside a
  graph that is only a short wait).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

SPARSE_BLOCK = "Qwen3MoeSparseMoeBlock"

# Most bytes the dense formulation's intermediates may take at once (experts are run in groups).
DENSE_BUDGET_BYTES = 256 << 20


def is_sparse(mlp: Any) -> bool:
    return type(mlp).__name__ == SPARSE_BLOCK


def moe_reason(layers: list[Any]) -> str | None:
    """Why the paged path cannot run these decoder layers' MLPs (None: it can)."""
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        if not is_sparse(mlp):
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                return f"layer {i}'s MLP ({type(mlp).__name__}) is neither a dense MLP nor {SPARSE_BLOCK}"
            continue
        gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
        if gate is None or experts is None or not hasattr(gate, "top_k"):
            return f"layer {i}'s {SPARSE_BLOCK} has no router with top_k or no experts"
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        layout = (
            getattr(experts, "has_gate", True),
            getattr(experts, "has_bias", False),
            getattr(experts, "is_transposed", False),
            getattr(experts, "is_concatenated", True),
        )
        if (
            not isinstance(gate_up, torch.Tensor)
            or not isinstance(down, torch.Tensor)
            or gate_up.dim() != 3
            or down.dim() != 3
            or layout != (True, False, False, True)
            or gate_up.shape[1] != 2 * down.shape[2]
        ):
            return (
                f"layer {i}'s experts are not in the layout the paged path reads (fused 3-D gate_up_proj "
                "[E, 2I, H] with the gate first and down_proj [E, H, I], no bias)"
            )
    return None


def grouped_mm_reason(dtype: torch.dtype, device: torch.device, hidden: int, inter: int) -> str | None:
    """Why :func:`experts_grouped` cannot run on ``device`` in ``dtype`` without a host
    synchronisation (None: it can).

    torch's grouped GEMM runs a device-side kernel for bfloat16 on compute capability 9.x and
    10.x; other dtypes and GPUs take a fallback that reads the group offsets on the host."""
    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return "this torch has no grouped_mm (torch >= 2.8 has torch._grouped_mm)"
    if device.type != "cuda":
        return f"grouped GEMMs without a host read need CUDA, not {device.type}"
    if dtype != torch.bfloat16:
        return f"torch's grouped GEMM kernel takes bfloat16, not {str(dtype).removeprefix('torch.')}"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"torch's grouped GEMM kernel needs compute capability 9.x or 10.x, not {major}.x"
    if hidden % 8 or inter % 8:
        return f"hidden size {hidden} and expert size {inter} must be multiples of 8 (16-byte rows)"
    return None


def route(h: torch.Tensor, router: Any, ids_out: torch.Tensor) -> torch.Tensor:
    """The router's top-k experts of each token of ``h`` [T, hidden], written into
    ``ids_out`` [T, top_k] (int64); returns their weights in ``h``'s dtype.

    ``Qwen3MoeTopKRouter.forward``'s arithmetic, with the indices written straight into the
    routing buffer (no copy, no host synchronisation)."""
    logits = F.linear(h, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values = probs.new_empty(ids_out.shape)
    torch.topk(probs, ids_out.shape[-1], dim=-1, out=(values, ids_out))
    if router.norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype)


def moe_modules(mlp: Any, h: torch.Tensor, ids_out: torch.Tensor) -> torch.Tensor:
    """The sparse block on ``h`` [T, hidden], through its own router and experts modules (what
    ``Qwen3MoeSparseMoeBlock.forward`` calls on the flattened tokens), recording the chosen
    experts into ``ids_out`` [T, top_k]."""
    _, weights, ids = mlp.gate(h)
    ids_out.copy_(ids)
    return mlp.experts(h, ids, weights)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=ends)


def experts_grouped(
    h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Any, expert_range: torch.Tensor
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert[ids[t, k]](h[t])`` with two grouped GEMMs, no host read.

    ``expert_range`` is ``arange(E)`` on the device. The pairs are sorted by expert; group
    ``e`` ends where ``searchsorted`` puts ``e`` (right side), so empty experts are empty groups.
    """
    tokens, top_k = ids.shape
    inter = experts.down_proj.shape[-1]
    pair_experts, order = torch.sort(ids.reshape(-1), stable=True)
    ends = torch.searchsorted(pair_experts, expert_range, right=True).to(torch.int32)
    x = h.index_select(0, order // top_k)
    gate_up = _grouped_mm(x, experts.gate_up_proj.transpose(1, 2), ends)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = _grouped_mm(act, experts.down_proj.transpose(1, 2), ends)
    y = y * weights.reshape(-1)[order].unsqueeze(-1)
    # Back to (token, k) order, then the sum over k: no atomics, so the result is deterministic.
    unsorted = y.new_empty((tokens * top_k, y.shape[-1])).index_copy_(0, order, y)
    return unsorted.view(tokens, top_k, -1).sum(dim=1).to(h.dtype)


def experts_dense(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: Any,
    budget_bytes: int = DENSE_BUDGET_BYTES,
) -> torch.Tensor:
    """The same sum with every expert run on every token (weight 0 where not chosen).

    Static shapes only (no sort, no group sizes), so any dtype captures into a CUDA graph;
    experts go in groups small enough that the intermediates stay under ``budget_bytes``."""
    tokens, hidden = h.shape
    num_experts = experts.gate_up_proj.shape[0]
    inter = experts.down_proj.shape[-1]
    share = torch.zeros(tokens, num_experts, dtype=torch.float32, device=h.device)
    share.scatter_(1, ids, weights.float())
    # Per expert: the broadcast input, gate/up, the activation and its product, the output in
    # the model dtype and in float32 (4 bytes an element, an upper bound).
    per_expert = tokens * (3 * hidden + 4 * inter) * 4
    group = max(1, min(num_experts, budget_bytes // max(per_expert, 1)))
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=h.device)
    for first in range(0, num_experts, group):
        last = min(first + group, num_experts)
        gate_up = torch.matmul(h, experts.gate_up_proj[first:last].transpose(1, 2))  # [g, T, 2I]
        act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        y = torch.bmm(act, experts.down_proj[first:last].transpose(1, 2))  # [g, T, H]
        out += torch.einsum("te,eth->th", share[:, first:last], y.float())
    return out.to(h.dtype)


def moe_fused(
    mlp: Any, h: torch.Tensor, ids_out: torch.Tensor, grouped: bool, expert_range: torch.Tensor
) -> torch.Tensor:
    """The sparse block on CUDA: router, then the experts by the way the step allows (see the
    module doc); the chosen experts go into ``ids_out``."""
    weights = route(h, mlp.gate, ids_out)
    if grouped:
        return experts_grouped(h, ids_out, weights, mlp.experts, expert_range)
    if torch.cuda.is_current_stream_capturing():
        return experts_dense(h, ids_out, weights, mlp.experts)
    return mlp.experts(h, ids_out, weights)
