"""Masked whitening and the padded token batch, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from miles.builtins.algorithms.tokens import TokenBatch
from miles.builtins.algorithms.whiten import masked_mean_std, masked_whiten
from miles.types import Prompt, Sample

torch = pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")


def test_whitens_over_all_loss_tokens_of_the_batch_with_bessel() -> None:
    # Loss tokens 1, 2, 3 (across two rows): mean 2, var ((1)² + 0 + (1)²) / (3 - 1) = 1.
    values = torch.tensor([[1.0, 2.0, INF], [3.0, NAN, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean_std(values, mask) == pytest.approx((2.0, 1.0))
    s = math.sqrt(1.0 + 1e-8)
    got = masked_whiten(values, mask)
    # Masked-out positions are exactly 0, even where they held inf or nan.
    assert got.flatten().tolist() == pytest.approx([-1 / s, 0.0, 0.0, 1 / s, 0.0, 0.0], abs=1e-12)


def test_one_token_zero_tokens_and_equal_tokens() -> None:
    one = torch.tensor([[5.0, 7.0]], dtype=torch.float64)
    # n = 1: std 0 (no Bessel), the token becomes (5 - 5) / sqrt(1e-8) = 0.
    assert masked_mean_std(one, torch.tensor([[1, 0]])) == (5.0, 0.0)
    assert masked_whiten(one, torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]
    # n = 0: nothing to whiten.
    assert masked_mean_std(one, torch.tensor([[0, 0]])) == (0.0, 0.0)
    assert masked_whiten(one, torch.tensor([[0, 0]])).tolist() == [[0.0, 0.0]]
    # All equal: zeros, not nan.
    same = torch.full((2, 3), 0.3, dtype=torch.float64)
    assert masked_whiten(same, torch.ones(2, 3)).tolist() == [[0.0] * 3] * 2


def sample(index: int, mask: list[int], **scores: list[float]) -> Sample:
    return Sample(
        prompt=Prompt(index=index, prompt="q"),
        group_index=1,
        response_ids=[0] * len(mask),
        loss_mask=mask,
        rollout_logprobs=[-0.5] * len(mask),
        token_scores=dict(scores),
    )


def test_token_batch_pads_and_unpads() -> None:
    batch = TokenBatch.from_samples([sample(0, [1, 0, 1]), sample(1, []), sample(2, [0, 1])], who="t")
    assert batch.mask.tolist() == [[True, False, True], [False] * 3, [False, True, False]]
    assert batch.valid.tolist() == [[True] * 3, [False] * 3, [True, True, False]]
    padded = batch.pad([[1.0, 2.0, 3.0], None, [4.0, 5.0]], "x")
    assert padded.dtype == torch.float64
    assert padded.tolist() == [[1.0, 2.0, 3.0], [0.0] * 3, [4.0, 5.0, 0.0]]
    # Back to rows: response lengths, exact zeros off the loss tokens.
    assert batch.rows(padded) == [[1.0, 0.0, 3.0], [], [0.0, 5.0]]
    empty = TokenBatch.from_samples([], who="t")
    assert empty.rows(empty.pad([], "x")) == []


def test_token_batch_errors_name_the_sample_and_the_field() -> None:
    bad = sample(7, [1, 1])
    bad.loss_mask = [1]
    with pytest.raises(ValueError, match=r"t: sample 1 of prompt 7: loss_mask has 1 entries, response has 2"):
        TokenBatch.from_samples([bad], who="t")
    batch = TokenBatch.from_samples([sample(3, [1, 1], values=[0.1, 0.2]), sample(4, [1])], who="t")
    with pytest.raises(
        ValueError, match=r"sample 1 of prompt 4 has no token_scores\['values'\] \(why\); it has: none"
    ):
        batch.score("values", why="why")
    with pytest.raises(ValueError, match=r"sample 1 of prompt 3: x has 1 entries, response has 2 tokens"):
        batch.pad([[0.0], [0.0]], "x")
