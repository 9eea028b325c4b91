"""megatron-core on CPU over gloo (``megatron.device: cpu``): the pieces its CUDA path hard-codes.

megatron-core 0.16's tensor-parallel layers (column- and row-parallel linears, the
vocab-parallel embedding) and the GPT model run on CPU over gloo, but three helpers on the
forward path allocate on ``torch.cuda.current_device()`` unconditionally. Each is given a
subclass here that computes the same thing on the CPU, installed on megatron's own instances:

- ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to CUDA on its first call
  (``rotary_pos_embedding.py``): :class:`CPURotaryEmbedding` keeps it where it is;
- the global memory buffer the local attention takes its score matrix from
  (``utils.GlobalMemoryBuffer.get_tensor``): :class:`CPUMemoryBuffer` allocates on the CPU;
- the RNG tracker the attention dropout forks (``tensor_parallel.random``) keeps CUDA generator
  states: :class:`CPURNGTracker` keeps CPU generator states, seeded as
  ``model_parallel_cuda_manual_seed`` seeds its CUDA ones.

The fourth, the default causal mask (``transformer.utils.get_default_causal_mask``, made on
``"cuda"`` when the attention mask is None), is avoided through megatron's API: the CPU trainer
passes an explicit mask (:func:`causal_mask`).

Not adapted, so refused on CPU: the MoE router (``router.py``, ``gating`` moves its weights to
CUDA on every call). What stays CUDA-only in megatron-core and so is not used on CPU: its ``DistributedDataParallel``
(gradient buffers on the current CUDA device), its optimizer and gradient clipping (``found_inf``
and norm tensors on ``"cuda"``), its forward/backward schedules (``total_num_tokens`` on
``"cuda"``) and the pipeline's point-to-point buffers. The CPU trainer runs torch's AdamW with
megatron's weight-decay groups, the TP reduction of the q/k-norm gradients megatron's
``finalize_model_grads`` does (:func:`reduce_tp_shared_grads`), its own tensor-parallel gradient
norm (:func:`clip_grad_norm`) and the no-pipelining schedule's loop itself
(``trainer.MegatronTrainer``).
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterable, Iterator
from functools import reduce
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state  # type: ignore[import-untyped]
from megatron.core.models.common.embeddings.rotary_pos_embedding import (  # type: ignore[import-untyped]
    RotaryEmbedding,
)
from megatron.core.tensor_parallel import random as mrandom  # type: ignore[import-untyped]
from megatron.core.tensor_parallel.layers import (  # type: ignore[import-untyped]
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.utils import GlobalMemoryBuffer  # type: ignore[import-untyped]


class CPURotaryEmbedding(RotaryEmbedding):
    """megatron's rotary embedding with its frequencies left on their (CPU) device."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


class CPUMemoryBuffer(GlobalMemoryBuffer):
    """megatron's global memory buffer, allocating on the CPU."""

    def get_tensor(
        self, tensor_shape: tuple[int, ...], dtype: torch.dtype, name: str, mem_alloc_context: Any = None
    ) -> torch.Tensor:
        required = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, requires_grad=False)
        return buf[0:required].view(*tensor_shape)


class CPURNGTracker(mrandom.CudaRNGStatesTracker):
    """megatron's RNG-states tracker over CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_runtime(seed: int) -> None:
    """The CPU memory buffer and RNG tracker (call after ``initialize_model_parallel``)."""
    parallel_state.get_global_memory_buffer().__class__ = CPUMemoryBuffer
    mrandom.initialize_rng_tracker(force_reset=True)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.__class__ = CPURNGTracker
    tracker.reset()
    # The seeds model_parallel_cuda_manual_seed gives the three states.
    offset = seed + 2718
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, offset + tp_rank)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    expert = (
        offset
        + 1
        + 100 * parallel_state.get_expert_model_parallel_rank()
        + parallel_state.get_expert_tensor_parallel_rank()
    )
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert)


def install_cpu_model(model: torch.nn.Module) -> None:
    """Every rotary embedding of ``model`` computes on the CPU."""
    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = CPURotaryEmbedding


def causal_mask(seq_len: int) -> torch.Tensor:
    """megatron's attention mask for causal rows of ``seq_len`` tokens ([1, 1, s, s], True: masked out)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def decays(name: str, p: torch.nn.Parameter) -> bool:
    """Whether megatron's optimizer applies weight decay to ``p``: not to biases and 1-D parameters."""
    return not (name.endswith(".bias") or p.dim() == 1)


def weight_decay_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Parameter groups as megatron's optimizer makes them: no decay for biases and 1-D parameters."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in named:
        if not p.requires_grad:
            continue
        (decay if decays(name, p) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def reduce_tp_shared_grads(model: torch.nn.Module, qk_layernorm: bool) -> None:
    """Sum over the TP group the gradients of replicated parameters that each TP rank only
    partly computes, as megatron's ``finalize_model_grads`` does with DDP: the q/k layer norms
    (shared by every head, and a TP rank holds a share of the heads), and average those marked
    ``average_gradients_across_tp_domain``."""
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if getattr(p, "average_gradients_across_tp_domain", False):
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dist.get_world_size(group))
        elif qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, group=group)


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float | None, grad_attr: str = "grad"
) -> float:
    """The gradient norm over the whole model-parallel group (each TP-duplicated parameter counted
    once, as megatron counts it), and the gradients scaled down to ``max_norm`` when it is above.

    ``grad_attr``: ``grad``, or ``main_grad`` where megatron's DDP accumulates (the streamed
    optimizer on CUDA); the sum is taken on the gradients' device (NCCL reduces CUDA tensors)."""
    present = [g for g in (getattr(p, grad_attr, None) for p in params) if g is not None]
    grads = [
        g
        for p in params
        if (g := getattr(p, grad_attr, None)) is not None and param_is_not_tensor_parallel_duplicate(p)
    ]
    device = present[0].device if present else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        squares += g.detach().double().pow(2).sum()
    group = parallel_state.get_model_parallel_group()  # TP x PP
    if dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    norm = math.sqrt(float(squares))
    if max_norm is not None and max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in present:
            g.mul_(scale)
    return norm
