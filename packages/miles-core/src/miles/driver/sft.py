"""The SFT stage: chat conversations -> training samples whose loss covers the assistant's tokens only.

A conversation is rendered by the tokenizer's chat template, and each assistant turn's
tokens are found by rendering the conversation up to that turn twice: once ending in
the generation prompt (where the assistant starts), once including the turn (where it
ends). Everything between is the assistant's and is trained on; the rest (system,
user and tool turns, the template's role headers) is context with loss mask 0. The
template must be append-only across these renders; a template that rewrites earlier
text (some strip past reasoning) is refused for that conversation with a clear error.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from miles.errors import DataError
from miles.interfaces import DataSource
from miles.types import Prompt, Sample, Status, TrainBatch


def _render(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(t) for t in ids]


def conversation_sample(tokenizer: Any, prompt: Prompt, max_length: int) -> Sample | None:
    """One SFT sample from a conversation, or None when truncation leaves no assistant token."""
    messages = prompt.prompt
    where = f"SFT conversation {prompt.index}"
    if not isinstance(messages, list):
        raise DataError(
            f"{where}: expected a list of chat messages (data.prompt_key pointing at e.g. 'messages'), got text"
        )
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise DataError(f"{where}: no assistant message to train on")
    if turns[0] == 0:
        raise DataError(f"{where}: starts with an assistant message; it needs a context to follow")
    ids = _render(tokenizer, messages, generation_prompt=False)
    mask = [0] * len(ids)
    for i in turns:
        start = _render(tokenizer, messages[:i], generation_prompt=True)
        end = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if ids[: len(start)] != start or ids[: len(end)] != end:
            raise DataError(
                f"{where}: the chat template is not append-only around assistant message {i} (rendering "
                "the conversation up to it is not a prefix of the whole); its tokens cannot be located"
            )
        for t in range(len(start), len(end)):
            mask[t] = 1
    first = next(t for t, m in enumerate(mask) if m)
    ids, mask = ids[:max_length], mask[:max_length]
    if first >= len(ids) or not any(mask[first:]):
        return None
    response = ids[first:]
    return Sample(
        prompt=prompt,
        prompt_ids=ids[:first],
        response_ids=response,
        loss_mask=mask[first:],
        rollout_logprobs=[0.0] * len(response),
        weight_versions=[0] * len(response),
        status=Status.COMPLETED,
    )


MakeSample = Callable[[Prompt], "Sample | None"]


class SFTStage:
    """Hands out one batch of ``batch_size`` training samples per step from the data source.

    ``make_sample`` turns a data item into its sample: for chat conversations
    (``tokens: True``) :func:`conversation_sample` with the policy's tokenizer, None when
    truncation leaves nothing to train on; for a ``SupervisedSampleSource`` the source's own
    ``supervised_sample`` (the sample carries a payload, no tokens).
    """

    def __init__(
        self, data_source: DataSource, make_sample: MakeSample, *, batch_size: int, tokens: bool
    ) -> None:
        self.data_source = data_source
        self.make_sample = make_sample
        self.batch_size = batch_size
        self.tokens = tokens

    @classmethod
    def conversations(
        cls, data_source: DataSource, tokenizer: Any, *, batch_size: int, max_length: int
    ) -> SFTStage:
        """Chat conversations, loss on the assistant's tokens."""
        return cls(
            data_source,
            lambda prompt: conversation_sample(tokenizer, prompt, max_length),
            batch_size=batch_size,
            tokens=True,
        )

    def next_batch(self, step: int) -> tuple[TrainBatch | None, dict[str, float]]:
        t0 = time.perf_counter()
        samples: list[Sample] = []
        skipped = 0
        for prompt in self.data_source.next_prompts(self.batch_size):
            sample = self.make_sample(prompt)
            if sample is None:
                skipped += 1
            else:
                samples.append(sample)
        if self.tokens:
            metrics = {"sft/conversations": float(len(samples)), "sft/skipped_truncated": float(skipped)}
        else:
            metrics = {"sft/samples": float(len(samples))}
        metrics["time/data_s"] = time.perf_counter() - t0
        if not samples:
            return None, metrics
        if not self.tokens:  # one advantage entry per sample: the row a payload's backend expects
            return TrainBatch(samples=samples, advantages=[[0.0] for _ in samples], step=step), metrics
        metrics["sft/seq_len_mean"] = statistics.fmean(s.total_length for s in samples)
        metrics["sft/loss_tokens_mean"] = statistics.fmean(sum(s.loss_mask) for s in samples)
        advantages = [[0.0] * len(s.response_ids) for s in samples]
        return TrainBatch(samples=samples, advantages=advantages, step=step), metrics
