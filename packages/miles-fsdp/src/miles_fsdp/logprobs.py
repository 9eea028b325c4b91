"""Per-token log-probabilities (and entropy) of sampled tokens, from logits, in bounded memory.

``log_softmax(logits / T)`` over a whole batch would materialise a float32 copy of the
logits (and autograd would keep it, plus the scaled copy, for backward). Here only
the rows that predict a response token are read, a chunk at a time, in float32;
backward recomputes the softmax of each chunk from the saved logits, so the extra
memory is one chunk plus the gradient of the logits that the model needs anyway.

Both outputs are differentiable: the entropy's gradient (for an entropy bonus) is
``dH/dx_j = -p_j (log p_j + H)``, folded into the same chunked backward pass.
"""

from __future__ import annotations

from typing import Any

import torch


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        rows: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = rows.numel()
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            x = logits.index_select(0, rows[start:end]).float()
            if temperature != 1.0:
                x.div_(temperature)
            chunk_lse = torch.logsumexp(x, dim=-1)
            lse[start:end] = chunk_lse
            logprobs[start:end] = x.gather(1, targets[start:end, None]).squeeze(1) - chunk_lse
            # H = lse - sum(p * x); the metric is a by-product of the softmax we already pay for.
            probs = torch.exp(x - chunk_lse[:, None])
            entropy[start:end] = chunk_lse - (probs * x).sum(dim=-1)
        ctx.save_for_backward(logits, rows, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk = chunk
        # An output the loss does not use gets None in backward, not zeros: no entropy work unless asked.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple:
        logits, rows, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad_logits = torch.zeros_like(logits)
        n = rows.numel()
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            x = logits.index_select(0, rows[start:end]).float()
            grad = _logit_grad(x, start, end, lse, targets, entropy, grad_logprobs, grad_entropy, temperature)
            # Rows are distinct positions, so a plain indexed copy is exact.
            grad_logits.index_copy_(0, rows[start:end], grad.to(grad_logits.dtype))
        return grad_logits, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets`` under ``softmax(logits[rows] / temperature)``, and its entropy.

    ``logits`` is ``[positions, vocab]`` (any float dtype); ``rows`` and ``targets`` are
    ``[n]`` (distinct row indices, token ids). Returns two float32 ``[n]`` tensors, both
    differentiable w.r.t. ``logits``: the log-probs and the entropies of those rows.
    """
    if logits.dim() != 2:
        raise ValueError(
            f"token_logprobs: logits must be [positions, vocab], got shape {tuple(logits.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    return _TokenLogProbs.apply(logits, rows, targets, float(temperature), int(chunk))


class _ProjectedTokenLogProbs(torch.autograd.Function):
    """``_TokenLogProbs`` with the output projection folded in: from hidden states, never full logits.

    A chunk of rows is projected (``h @ W.T + b``, in the weights' dtype, as the model's own head
    computes it), read in float32, scaled by the temperature and reduced; backward projects each
    chunk again and turns the chunk's logit gradient into the hidden states' and the weight's.
    Memory: one chunk of logits (float32) and the weight's gradient, instead of the
    ``[positions, vocab]`` logits and their gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            x = _project(hidden[start:end], weight, bias).float()
            if temperature != 1.0:
                x.div_(temperature)
            chunk_lse = torch.logsumexp(x, dim=-1)
            lse[start:end] = chunk_lse
            logprobs[start:end] = x.gather(1, targets[start:end, None]).squeeze(1) - chunk_lse
            probs = torch.exp(x - chunk_lse[:, None])
            entropy[start:end] = chunk_lse - (probs * x).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # Accumulated over chunks in float32, cast once: a bf16 running sum would lose the small ones.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end]
            x = _project(h, weight, bias).float()
            grad = _logit_grad(x, start, end, lse, targets, entropy, grad_logprobs, grad_entropy, temperature)
            g = grad.to(weight.dtype)  # the logits' gradient, in the dtype the head computes in
            if grad_hidden is not None:
                grad_hidden[start:end] = g @ weight
            grad_weight += (g.t() @ h).float()
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def _project(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(h, weight, bias)


def projected_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` of ``linear(hidden, weight, bias)`` without materialising those logits.

    ``hidden`` is ``[n, H]``: the hidden states of the rows that predict ``targets`` (``[n]``);
    ``weight`` is the output projection ``[vocab, H]``. Returns the float32 ``[n]`` log-probs of
    ``targets`` under ``softmax(logits / temperature)`` and the entropies, differentiable w.r.t.
    ``hidden``, ``weight`` and ``bias``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"projected_token_logprobs: hidden [n, H] and weight [vocab, H] expected, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"projected_token_logprobs: temperature must be > 0, got {temperature}")
    return _ProjectedTokenLogProbs.apply(hidden, weight, bias, targets, float(temperature), int(chunk))


def _logit_grad(
    x: torch.Tensor,
    start: int,
    end: int,
    lse: torch.Tensor,
    targets: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The gradient with respect to one chunk's raw logits ``x`` (rows ``start:end``, float32, consumed).

    d/dx [x_t - lse(x)] = onehot(t) - softmax(x) for the log-prob, -p·(log p + H) for the entropy;
    the chain through x / T divides both by T.
    """
    if temperature != 1.0:
        x.div_(temperature)
    log_p = x.sub_(lse[start:end, None])
    probs = torch.exp(log_p)
    if grad_logprobs is not None:
        g_out = grad_logprobs[start:end, None].float()
        grad = probs * -g_out
        grad.scatter_add_(1, targets[start:end, None], g_out)
    else:
        grad = torch.zeros_like(x)
    if grad_entropy is not None:
        g_ent = grad_entropy[start:end, None].float()
        grad.sub_(probs * (log_p + entropy[start:end, None]) * g_ent)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad
