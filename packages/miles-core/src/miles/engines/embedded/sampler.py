"""The decode loop: prefill, one-token steps over a left-padded batch, and sampling.

A running batch keeps one ``DynamicCache`` for all its rows. Every row is
left-padded, so its real tokens always end at the right edge; the attention mask
marks padding and ``position_ids`` count each row's real tokens. Each row has one
*pending* token: sampled, returned to the caller, not yet fed to the model. A
decode step feeds the pending tokens of all rows at once.

New requests are prefilled as their own batch and then merged into the running
one (caches and masks left-padded to a common length), so a request joins at the
next step instead of waiting for the batch to drain (continuous batching). This
needs plain ``DynamicLayer`` caches; for models whose cache has other layer
types (sliding windows, linear attention) :func:`cache_is_mergeable` says no and
the scheduler admits new requests only into an empty batch.

Prefix-cache hits (see ``prefix_cache``): a row whose first ``c`` tokens have cached
KV feeds only the rest, at positions ``c ..``, on top of a copy of that KV. Rows with
hits are prefilled together (their cached KV left-padded to the longest, their new
tokens left-padded as usual), so such a row's mask has a gap of padding between its
cached prefix and its new tokens; positions and the mask account for it, and
:func:`row_kv` reads a row's KV back through the mask. Rows without a hit take the
plain path, as if there were no cache.

Reported log-probabilities: for a row sampled at temperature ``T > 0`` the
logprob of token ``t`` is ``log_softmax(logits / T)[t]``, taken over the *full*
vocabulary, before top-k / top-p truncation. That is exactly what the trainer
recomputes from its own forward pass, so train/rollout mismatch measures only the
numerical difference between the two. Greedy rows (``T == 0``) report
``log_softmax(logits)[t]``.

Scoring (input log-probs, SGLang's ``logprob_start_len``): a request with
``logprob_start = s`` reports one entry per prompt position ``s .. P-1``. Entry 0
carries no value (SGLang pads it with null whatever ``s`` is: the logits that
would score it belong to position ``s - 1``, which is not computed); entry
``j >= 1`` is ``log_softmax(logits[s+j-1] / T)[prompt[s+j]]``, the formula of the
output log-probs (``T == 0`` scores at ``T = 1``). Top-K and requested-id
log-probs come from the same row. They are taken from the prefill forward pass
that also samples the first output token: the model keeps the logits of the
last ``P - s`` columns only. When ``rows x columns x vocab`` would exceed
``Runner.logits_budget``, the prefill runs in sequence chunks through the KV
cache, so that no more logits than the budget are alive at once. A request with
``max_new_tokens == 0`` is scored and answered without sampling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from miles.engines.embedded.lora import LoraServing
    from miles.engines.embedded.prefix_cache import KVLayers, PrefixHit
    from miles.engines.embedded.routing import RoutingRecorder


# Top-K log-probs at one position: (log-probs in descending order, their token ids).
TopEntry = tuple[list[float], list[int]]


@dataclass(eq=False)
class GenRequest:
    """One ``/generate`` request as the scheduler sees it."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None
    lora: str | None = None  # the LoRA adapter this request generates with (None: the base)
    return_logprob: bool = True
    return_routed_experts: bool = False
    routed_start: int = 0  # first position whose routing is returned
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)  # weight version of each output token
    # Routing of every consumed token in position order, as int32 chunks of [n, num_layers, topk]
    # (copies, so a prefill's whole-batch capture is not kept alive by one row).
    routed: list[torch.Tensor] = field(default_factory=list)
    num_routed: int = 0
    finish: dict[str, Any] | None = None
    error: str | None = None
    abort_requested: bool = False
    generator: torch.Generator | None = None
    on_done: Any = None  # callable(GenRequest), called once from the scheduler thread
    # Scoring (SGLang's logprob_start_len, top_logprobs_num, token_ids_logprob; see the module doc).
    logprob_start: int | None = None  # first prompt position reported; None: no input log-probs
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # the same ids at every position (SGLang)
    token_ids_per_position: list[list[int]] | None = None  # one id list per reported position (extension)
    input_logprobs: list[float] = field(default_factory=list)  # prompt positions logprob_start+1 .. P-1
    input_top: list[TopEntry] = field(default_factory=list)
    input_ids_logprobs: list[list[float]] = field(default_factory=list)
    output_top: list[TopEntry] = field(default_factory=list)  # one per output token
    output_ids_logprobs: list[list[float]] = field(default_factory=list)
    input_scored: bool = False  # set once; a retracted request is not scored again
    # Prefix cache (set by the scheduler): prompt tokens the first prefill took from the cache
    # (meta_info.cached_tokens), and the cache generation the row's KV was started under.
    cached_tokens: int = 0
    kv_generation: int = -1

    @property
    def sequence(self) -> list[int]:
        """What a prefill feeds: the prompt and every output so far (a retracted row's included)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_fed(self) -> int:
        """Tokens the model has consumed: the prompt and every output but the pending one."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def pending_input_positions(self) -> int:
        """Prompt positions whose logits the next prefill must keep for input log-probs."""
        if self.logprob_start is None or self.input_scored:
            return 0
        return len(self.prompt_ids) - 1 - self.logprob_start

    @property
    def wants_extras(self) -> bool:
        """Top-K or requested-id log-probs for every sampled token."""
        return self.return_logprob and (self.top_logprobs_num > 0 or self.token_ids_logprob is not None)


def cache_is_mergeable(model: Any) -> bool:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    return all(type(layer) is DynamicLayer for layer in cache.layers)


# ------------------------------------------------------------------- sampling


def top_and_requested(
    logp: torch.Tensor, top_k: int, token_ids: list[int] | list[list[int]] | None
) -> tuple[list[TopEntry], list[list[float]]]:
    """Per row of log-probs ``logp`` [m, V]: the ``top_k`` best (sorted, descending) and the
    log-probs of ``token_ids`` (one flat list for every row, or one list per row), in the
    order the ids were given. Either result is empty when not asked for."""
    tops: list[TopEntry] = []
    if top_k > 0:
        values, indices = torch.topk(logp, top_k, dim=-1)
        tops = list(zip(values.tolist(), indices.tolist(), strict=True))
    requested: list[list[float]] = []
    if token_ids is None:
        pass
    elif token_ids and isinstance(token_ids[0], list):
        # Ragged lists: gather from a zero-padded index, then cut each row back to its length.
        index = torch.zeros(len(token_ids), max(len(ids) for ids in token_ids), dtype=torch.long)
        for i, ids in enumerate(token_ids):
            index[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        gathered = logp.gather(1, index.to(logp.device)).tolist()
        requested = [row[: len(ids)] for row, ids in zip(gathered, token_ids, strict=True)]
    else:
        index = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
        requested = logp.index_select(1, index).tolist()
    return tops, requested


# Below this a temperature is treated as 0 (greedy): dividing float32 logits by it would overflow.
MIN_TEMPERATURE = 1e-5


def sample_tokens(
    logits: torch.Tensor, rows: Sequence[GenRequest], default_generator: torch.Generator
) -> tuple[list[int], list[float], torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; returns the tokens, their logprobs and
    the full log-probs [B, V] they were taken from."""
    logits = logits.float()
    temps = torch.tensor(
        [r.temperature if r.temperature >= MIN_TEMPERATURE else 1.0 for r in rows],
        device=logits.device,
        dtype=torch.float32,
    )
    logp = F.log_softmax(logits / temps[:, None], dim=-1)
    vocab = logits.shape[-1]
    tokens: list[int] = []
    for i, row in enumerate(rows):
        if row.temperature < MIN_TEMPERATURE:  # greedy; also what a vanishing temperature tends to
            tokens.append(int(torch.argmax(logits[i])))
            continue
        filtered = logp[i]
        if 0 < row.top_k < vocab:
            kth = torch.topk(filtered, row.top_k).values[-1]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if row.top_p < 1.0:
            sorted_lp, order = torch.sort(filtered, descending=True)
            probs = sorted_lp.exp()
            # Drop a token once the mass before it already reaches top_p (the top token always stays).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= row.top_p
            drop[0] = False  # even when top_p rounds to 0 in float32 (a subnormal top_p)
            filtered = filtered.clone()
            filtered[order[drop]] = float("-inf")
        probs = torch.softmax(filtered, dim=-1)
        gen = row.generator if row.generator is not None else default_generator
        tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    index = torch.tensor(tokens, device=logits.device)[:, None]
    chosen = logp.gather(1, index).squeeze(1).tolist()
    return tokens, chosen, logp


# ---------------------------------------------------------------- the batch


@dataclass
class DecodeBatch:
    rows: list[GenRequest]
    cache: Any  # transformers DynamicCache covering every fed token
    mask: torch.Tensor  # [B, cache_len] long, 1 on real tokens

    def __len__(self) -> int:
        return len(self.rows)


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _rebuild_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=layers)


def merge_batches(a: DecodeBatch | None, b: DecodeBatch | None) -> DecodeBatch | None:
    """One batch with the rows of both; the shorter cache is left-padded (masked)."""
    if a is None or not a.rows:
        return b
    if b is None or not b.rows:
        return a
    length = max(a.mask.shape[1], b.mask.shape[1])
    layers = []
    for (ka, va, _), (kb, vb, _) in zip(a.cache, b.cache, strict=True):
        layers.append(
            (
                torch.cat([_pad_left(ka, length, -2), _pad_left(kb, length, -2)], dim=0),
                torch.cat([_pad_left(va, length, -2), _pad_left(vb, length, -2)], dim=0),
            )
        )
    mask = torch.cat([_pad_left(a.mask, length, 1), _pad_left(b.mask, length, 1)], dim=0)
    return DecodeBatch(rows=a.rows + b.rows, cache=_rebuild_cache(layers), mask=mask)


def row_kv(batch: DecodeBatch, i: int) -> KVLayers:
    """Row ``i``'s KV without padding: per layer ``(key, value)``, each ``[1, kv_heads, n, head_dim]``
    with ``n`` the tokens the row consumed; fresh tensors that share no memory with the batch."""
    columns = batch.mask[i].nonzero().squeeze(1)
    return [
        (k[i : i + 1].index_select(2, columns), v[i : i + 1].index_select(2, columns))
        for k, v, _ in batch.cache
    ]


def select_rows(batch: DecodeBatch, keep: list[int], mergeable: bool) -> DecodeBatch | None:
    """Keep only rows ``keep``; drop cache columns that became padding for every row."""
    if not keep:
        return None
    if len(keep) == len(batch.rows):
        return batch
    index = torch.tensor(keep, device=batch.mask.device)
    mask = batch.mask.index_select(0, index)
    if not mergeable:
        batch.cache.batch_select_indices(index)
        return DecodeBatch(rows=[batch.rows[i] for i in keep], cache=batch.cache, mask=mask)
    real = mask.any(dim=0).nonzero()
    start = int(real[0]) if len(real) else 0
    layers = [
        (k.index_select(0, index)[..., start:, :], v.index_select(0, index)[..., start:, :])
        for k, v, _ in batch.cache
    ]
    return DecodeBatch(rows=[batch.rows[i] for i in keep], cache=_rebuild_cache(layers), mask=mask[:, start:])


class Runner:
    """Runs the model: prefill new rows (scoring their prompts on request), decode one step, sample,
    record routing."""

    #: Most logits (rows x sequence columns x vocabulary entries) one prefill forward may return;
    #: a prefill that must keep more for input log-probs runs in sequence chunks (256 MiB of float32).
    logits_budget: int = 1 << 26

    def __init__(
        self,
        model: Any,
        device: torch.device,
        *,
        max_context: int,
        recorder: RoutingRecorder | None,
        seed: int | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.max_context = max_context
        self.lora: LoraServing | None = None  # set by the engine
        self.recorder = recorder if recorder is not None and recorder.is_moe else None
        head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(head.weight.shape[0]) if head is not None else int(config.vocab_size)
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def new_generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def _forward(
        self,
        rows: list[GenRequest],
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        keep: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the last ``keep`` columns [B, keep, V], and the routing when recorded."""
        recorder = self.recorder if any(r.return_routed_experts for r in rows) else None
        if recorder is not None:
            recorder.start()
        adapters = [r.lora for r in rows]
        lora = (
            self.lora.rows(adapters)
            if self.lora is not None and any(a is not None for a in adapters)
            else contextlib.nullcontext()
        )
        try:
            with lora:
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=keep,
                )
        finally:
            routing = recorder.stop(*input_ids.shape) if recorder is not None else None
        return out.logits, routing

    def _spans(self, batch: int, width: int, keep: int) -> list[tuple[int, int, int]]:
        """The prefill forwards as ``(first column, end column, logits kept)``: one pass when the
        kept logits fit the budget, else the unscored head in one pass and the scored tail in
        chunks of as many columns as the budget allows."""
        step = max(1, self.logits_budget // (batch * self.vocab_size))
        if keep <= step:
            return [(0, width, keep)]
        first = width - keep
        spans = [(0, first, 1)] if first > 0 else []
        spans += [(a, min(a + step, width), min(a + step, width) - a) for a in range(first, width, step)]
        return spans

    @torch.inference_mode()
    def prefill(self, rows: list[GenRequest], hits: Sequence[PrefixHit | None] | None = None) -> DecodeBatch:
        """Feed every row's :attr:`~GenRequest.sequence`; record the requested input log-probs
        and routing; sample the next token.

        ``hits[i]``, when given, holds cached KV of row ``i``'s first ``hits[i].length``
        tokens (the caller has checked that none of the row's scored positions lies
        inside it, and that it carries routing where the row needs it): such rows feed
        only the rest. Rows without a hit are prefilled exactly as without a cache.
        """
        if hits is None or not any(hits):
            return self._prefill(rows, [r.sequence for r in rows])
        cold = [r for r, h in zip(rows, hits, strict=True) if h is None]
        warm = [(r, h) for r, h in zip(rows, hits, strict=True) if h is not None]
        batch = self._prefill(cold, [r.sequence for r in cold]) if cold else None
        merged = merge_batches(batch, self._prefill_on_hits(warm))
        assert merged is not None  # the hits' batch is never None
        return merged

    def _prefill_on_hits(self, pairs: list[tuple[GenRequest, PrefixHit]]) -> DecodeBatch:
        """Prefill rows on top of their cached prefixes, all in one batch."""
        longest = max(hit.length for _, hit in pairs)
        layers = []
        # torch.cat copies, so decoding never writes into a cache entry (nor does DynamicLayer,
        # which only ever concatenates).
        for per_row in zip(*(hit.kv() for _, hit in pairs), strict=True):
            layers.append(
                (
                    torch.cat([_pad_left(k, longest, -2) for k, _ in per_row], dim=0),
                    torch.cat([_pad_left(v, longest, -2) for _, v in per_row], dim=0),
                )
            )
        past_mask = torch.zeros(len(pairs), longest, dtype=torch.long, device=self.device)
        for i, (row, hit) in enumerate(pairs):
            past_mask[i, longest - hit.length :] = 1
            if row.return_routed_experts and row.num_routed < hit.length:
                routed = hit.routed()
                if routed is None:
                    raise RuntimeError(
                        f"request {row.rid}: a prefix-cache hit without routing for a routed row"
                    )
                row.routed.append(routed[row.num_routed :].clone())
                row.num_routed = hit.length
        rows = [row for row, _ in pairs]
        tails = [row.sequence[hit.length :] for row, hit in pairs]
        past = (_rebuild_cache(layers), past_mask, [hit.length for _, hit in pairs])
        return self._prefill(rows, tails, past)

    def _prefill(
        self,
        rows: list[GenRequest],
        tails: list[list[int]],
        past: tuple[Any, torch.Tensor, list[int]] | None = None,
    ) -> DecodeBatch:
        """Feed ``tails[i]``, the end of row ``i``'s sequence, left-padded; sample.

        ``past``: ``(cache, mask [B, C], starts)`` when the rows' first ``starts[i]``
        tokens are already in ``cache`` (else a fresh cache and ``tails`` are the whole
        sequences). Each tail ends at the right edge, so column ``c`` holds sequence
        position ``c - width + len(sequence)`` for every row, with or without a past.
        """
        from transformers import DynamicCache

        width = max(len(t) for t in tails)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, t in enumerate(tails):
            ids[i, width - len(t) :] = torch.tensor(t, dtype=torch.long)
            mask[i, width - len(t) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if past is None:
            cache, starts = DynamicCache(config=self.model.config), [0] * len(rows)
        else:
            cache, past_mask, starts = past
            positions = positions + torch.tensor(starts, dtype=torch.long, device=self.device)[:, None]
            mask = torch.cat([past_mask, mask], dim=1)
        past_len = mask.shape[1] - width
        # Rows are left-padded, so every position a row scores lies in the last `keep` columns.
        keep = 1 + max(r.pending_input_positions for r in rows)
        routed_parts: list[torch.Tensor] = []
        logits = None
        for a, b, kept in self._spans(len(rows), width, keep):
            logits, routing = self._forward(
                rows, ids[:, a:b], mask[:, : past_len + b], positions[:, a:b], cache, kept
            )
            if routing is not None:
                routed_parts.append(routing)
            if keep > 1:
                self._record_input_scores(rows, ids, b - kept, logits)
        for row in rows:
            if row.logprob_start is not None:
                row.input_scored = True
        if routed_parts:
            all_routed = torch.cat(routed_parts, dim=1)
            for i, (row, tail, start) in enumerate(zip(rows, tails, starts, strict=True)):
                end = start + len(tail)
                if row.return_routed_experts and row.num_routed < end:
                    first = width - end + row.num_routed  # the column of position num_routed
                    row.routed.append(all_routed[i, first:].clone())
                    row.num_routed = end
        assert logits is not None  # _spans yields at least one span
        self._append(rows, logits[:, -1, :])
        return DecodeBatch(rows=list(rows), cache=cache, mask=mask)

    def _record_input_scores(
        self, rows: list[GenRequest], ids: torch.Tensor, first_col: int, logits: torch.Tensor
    ) -> None:
        """Append the input log-probs that ``logits`` (columns ``first_col ..``) hold for each row.

        Column ``c`` of a row predicts the token in column ``c + 1``; a row scores the columns
        of prompt positions ``logprob_start .. P-2``, which end just before the last column.
        """
        width = ids.shape[1]
        end_col = first_col + logits.shape[1]
        for i, row in enumerate(rows):
            pending = row.pending_input_positions
            if pending <= 0 or row.logprob_start is None:  # (pending is 0 without a logprob_start)
                continue
            lo, hi = max(first_col, width - 1 - pending), min(end_col, width - 1)
            if lo >= hi:
                continue
            targets = ids[i, lo + 1 : hi + 1]
            per_position = None
            if row.token_ids_per_position is not None:
                # Column c holds prompt position p = c - (width - P); it scores entry p + 1 - start.
                entry = lo - (width - len(row.prompt_ids)) + 1 - row.logprob_start
                per_position = row.token_ids_per_position[entry : entry + hi - lo]
            t = row.temperature if row.temperature > 0 else 1.0
            logp = F.log_softmax(logits[i, lo - first_col : hi - first_col].float() / t, dim=-1)
            row.input_logprobs += logp.gather(1, targets[:, None]).squeeze(1).tolist()
            tops, requested = top_and_requested(
                logp,
                row.top_logprobs_num,
                per_position if per_position is not None else row.token_ids_logprob,
            )
            row.input_top += tops
            row.input_ids_logprobs += requested

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> None:
        """Feed each row's pending token; sample the next one."""
        rows = batch.rows
        ids = torch.tensor([[r.output_ids[-1]] for r in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[r.num_fed] for r in rows], dtype=torch.long, device=self.device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(rows), 1)], dim=1)
        logits, routing = self._forward(rows, ids, batch.mask, positions, batch.cache)
        if routing is not None:
            for i, row in enumerate(rows):
                if row.return_routed_experts:
                    row.routed.append(routing[i, 0:1].clone())
                    row.num_routed += 1
        self._append(rows, logits[:, -1, :])

    def _append(self, rows: list[GenRequest], logits: torch.Tensor) -> None:
        # A pure scoring request (max_new_tokens 0) is done once its prompt went through the model.
        sampling = [i for i, row in enumerate(rows) if row.max_new_tokens > 0]
        for row in rows:
            if row.max_new_tokens <= 0:
                row.finish = {"type": "length", "length": 0}
        if not sampling:
            return
        if len(sampling) < len(rows):
            rows = [rows[i] for i in sampling]
            logits = logits[torch.tensor(sampling, device=logits.device)]
        tokens, logprobs, logp = sample_tokens(logits, rows, self.generator)
        for i, (row, tok, lp) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            row.output_ids.append(tok)
            row.output_logprobs.append(lp)
            if row.wants_extras:
                tops, requested = top_and_requested(
                    logp[i : i + 1], row.top_logprobs_num, row.token_ids_logprob
                )
                row.output_top += tops
                row.output_ids_logprobs += requested
            if tok in row.stop_ids:
                row.finish = {"type": "stop", "matched": tok}
            elif (
                len(row.output_ids) >= row.max_new_tokens
                or len(row.prompt_ids) + len(row.output_ids) >= self.max_context
            ):
                row.finish = {"type": "length", "length": len(row.output_ids)}
