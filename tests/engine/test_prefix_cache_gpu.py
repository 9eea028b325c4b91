"""The prefix cache on CUDA: a growing conversation and a batch mixing cached lengths answer exactly as
an engine without the cache (float32), and the cache really saves prefill. Run by scripts/gpu-tests.sh."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.test_prefix_cache import Served, assert_same, body, cached, tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cuda_pair(dense_dir: Path) -> Iterator[tuple[Served, Served]]:
    # The prefix cache is the DynamicCache path's (on CUDA, "auto" would pick the paged path).
    on = Served(dense_dir, device="cuda", max_batch_size=16, kv_cache="dynamic")
    off = Served(dense_dir, device="cuda", max_batch_size=16, prefix_cache_tokens=0, kv_cache="dynamic")
    yield on, off
    on.close()
    off.close()


def test_a_growing_conversation_on_cuda_answers_as_without_the_cache(cuda_pair) -> None:
    on, off = cuda_pair
    rng = random.Random(0)
    ids = tokens(rng, 64)
    fed_before = on.stats()["prefilled_tokens"]
    sent = reusable = 0
    for _ in range(6):
        got, want = on.generate(body(ids, n=8)), off.generate(body(ids, n=8))
        assert_same(got, want)
        # Turn k+1 reuses everything turn k consumed: its prompt and all outputs but the last.
        assert cached(got) == reusable
        reusable = len(ids) + len(got["output_ids"]) - 1
        sent += len(ids)
        ids = ids + got["output_ids"] + tokens(rng, 20)
    fed = on.stats()["prefilled_tokens"] - fed_before
    assert fed < sent / 3  # without the cache every prompt token is prefilled


def test_rows_with_different_cached_lengths_and_a_cold_row_batch_on_cuda(cuda_pair) -> None:
    on, off = cuda_pair
    rng = random.Random(1)
    short, long = tokens(rng, 40), tokens(rng, 90)
    for ids in (short, long):  # seed the cache with both prefixes
        on.generate(body(ids, n=4))
    batch = [body(short + tokens(rng, 10)), body(long + tokens(rng, 5)), body(tokens(rng, 70))]
    got = on.generate_together(batch)
    want = off.generate_together(batch)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    assert [cached(g) > 0 for g in got] == [True, True, False]
