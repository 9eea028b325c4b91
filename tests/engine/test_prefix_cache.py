"""The embedded engine's prefix cache: a session's next turn prefills only its new tokens, answers
exactly as an engine without the cache would, and the cache is never used where it would be wrong
(after a weight change, for scored or routed positions it lacks, on models whose caches cannot merge).

Engines run in this process behind their real HTTP app (httpx's ASGI transport, no sockets); a
tiny model loads in well under a second.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.helpers import VOCAB, greedy_local, load_local, make_tiny_qwen3
from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions
from miles.engines.embedded.prefix_cache import MIN_TOKENS, PrefixCache, common_prefix_length
from miles.engines.embedded.scheduler import Scheduler
from miles.engines.embedded.server import create_app

TOL = 1e-4  # float32 on the CPU: the cached and the recomputed KV differ by rounding only


# ------------------------------------------------------------------ helpers


class Served:
    """An embedded engine in this process, driven through its HTTP app."""

    def __init__(self, model_dir: Path, **options: Any) -> None:
        self.engine = EmbeddedEngine(EngineOptions(model_path=str(model_dir), dtype="float32", **options))
        self.engine.start()
        self.app = create_app(self.engine)

    def close(self) -> None:
        self.engine.stop()

    async def _call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as http:
            return await http.request(method, path, json=body)

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return asyncio.run(self._call("POST", path, body))

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post("/generate", body)
        assert r.status_code == 200, r.text
        return r.json()

    def generate_together(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Answers to ``bodies``, all admitted by one scheduler step (so prefilled as one batch)."""
        scheduler = self.engine.scheduler
        scheduler.pause("in_place")  # nothing runs: the requests queue up

        async def go() -> list[httpx.Response]:
            tasks = [asyncio.create_task(self._call("POST", "/generate", b)) for b in bodies]
            while scheduler.counts()[1] < len(bodies):
                await asyncio.sleep(0.002)
            scheduler.resume()
            return await asyncio.gather(*tasks)

        answers = asyncio.run(go())
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        return [r.json() for r in answers]

    def info(self) -> dict[str, Any]:
        return asyncio.run(self._call("GET", "/get_server_info")).json()

    def stats(self) -> dict[str, Any]:
        return self.info()["batch_stats"]


def body(ids: list[int], n: int = 6, temperature: float = 0.0, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True}
    if temperature > 0:
        params["sampling_seed"] = 7
    return {"input_ids": ids, "return_logprob": True, "sampling_params": params, **extra}


def logprobs(answer: dict[str, Any], field: str = "output_token_logprobs") -> list[float | None]:
    return [entry[0] for entry in answer["meta_info"][field]]


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same tokens, and log-probs equal within float tolerance."""
    assert got["output_ids"] == want["output_ids"]
    assert logprobs(got) == pytest.approx(logprobs(want), abs=TOL)
    if "input_token_logprobs" in want["meta_info"]:
        assert logprobs(got, "input_token_logprobs") == pytest.approx(
            logprobs(want, "input_token_logprobs"), abs=TOL
        )


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def cached(answer: dict[str, Any]) -> int:
    return answer["meta_info"]["cached_tokens"]


def wait_running(served: Served, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while served.engine.scheduler.counts()[0] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.001)


# --------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def on(dense_dir: Path) -> Iterator[Served]:
    served = Served(dense_dir, max_batch_size=16)
    yield served
    served.close()


@pytest.fixture(scope="module")
def off(dense_dir: Path) -> Iterator[Served]:
    served = Served(dense_dir, max_batch_size=16, prefix_cache_tokens=0)
    yield served
    served.close()


@pytest.fixture(scope="module")
def moe_dir(engine_tmp: Path) -> Path:
    return make_tiny_qwen3(engine_tmp / "prefix-moe", seed=0, moe=True)


# ------------------------------------------------------- the cache alone


def kv(n: int, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of [1, kv_heads=1, n, head_dim=2] (4 float32 per token and layer, 32 bytes per token)."""
    return [(torch.full((1, 1, n, 2), fill), torch.full((1, 1, n, 2), fill)) for _ in range(2)]


BASE = list(range(100, 100 + MIN_TOKENS))  # a shared first block


def test_lookup_finds_the_longest_common_prefix_within_the_callers_limit() -> None:
    cache = PrefixCache(1000)
    short, long = [*BASE, 1, 2], [*BASE, 1, 2, 3, 4, 5]
    other = [*BASE, 9, 9, 9, 9, 9, 9]
    cache.insert([*short, 7], kv(len(short) + 1))  # diverges from `long` after `short`
    cache.insert(long, kv(len(long), 1.0))
    cache.insert(other, kv(len(other), 2.0))
    hit = cache.lookup([*long, 6, 6], len(long) + 1)
    assert hit is not None and hit.entry.tokens == long and hit.length == len(long)
    # Any prefix of an entry is valid KV: a prompt that diverges inside an entry reuses what comes before.
    hit = cache.lookup([*BASE, 1, 2, 3, 8, 8], 100)
    assert hit is not None and hit.entry.tokens == long and hit.length == MIN_TOKENS + 3
    assert [k.shape[2] for k, _ in hit.kv()] == [MIN_TOKENS + 3] * 2
    # The caller's limit (e.g. "leave the last token to be fed") caps the length.
    hit = cache.lookup(long, len(long) - 1)
    assert hit is not None and hit.length == len(long) - 1
    # Nothing is shared with an unrelated prompt, or beyond a limit below one block.
    assert cache.lookup(list(range(50)), 49) is None
    assert cache.lookup(long, MIN_TOKENS - 1) is None


def test_an_extending_entry_replaces_the_old_one_and_a_covered_one_is_not_stored() -> None:
    cache = PrefixCache(1000)
    turn1 = [*BASE, 1, 2, 3]
    turn2 = [*turn1, 4, 5, 6]
    assert cache.insert(turn1, kv(len(turn1)))
    assert cache.insert(turn2, kv(len(turn2)))
    assert len(cache) == 1 and cache.num_tokens == len(turn2)  # one entry per live session
    assert not cache.insert(turn1, kv(len(turn1)))  # already covered by turn2
    assert len(cache) == 1 and cache.nbytes == len(turn2) * 32
    # A branch (same history, another continuation) is a second entry.
    assert cache.insert([*turn1, 7], kv(len(turn1) + 1))
    assert len(cache) == 2


def test_least_recently_used_entries_are_evicted_beyond_the_token_budget() -> None:
    cache = PrefixCache(3 * MIN_TOKENS)
    a, b, c = ([k] * MIN_TOKENS for k in (1, 2, 3))
    for entry in (a, b, c):
        assert cache.insert(entry, kv(MIN_TOKENS))
    assert cache.lookup([*a, 0], MIN_TOKENS) is not None  # a use: b is now the least recent
    assert cache.insert([4] * MIN_TOKENS, kv(MIN_TOKENS))
    assert cache.lookup([*b, 0], MIN_TOKENS) is None
    assert cache.lookup([*a, 0], MIN_TOKENS) is not None
    assert cache.num_tokens == 3 * MIN_TOKENS and cache.evictions == 1
    # Too short to index, or larger than the whole budget: not stored.
    assert not cache.insert([5] * (MIN_TOKENS - 1), kv(MIN_TOKENS - 1))
    assert not cache.insert([6] * (3 * MIN_TOKENS + 1), kv(3 * MIN_TOKENS + 1))
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        PrefixCache(0)


def test_routing_is_kept_with_the_kv_and_required_only_when_asked() -> None:
    cache = PrefixCache(1000)
    plain = [*BASE, 1, 2]
    cache.insert(plain, kv(len(plain)))
    assert cache.lookup([*plain, 3], 100, need_routing=True) is None
    assert cache.lookup([*plain, 3], 100) is not None
    routed = torch.arange(len(plain) * 4, dtype=torch.int32).reshape(len(plain), 2, 2)
    assert cache.insert(plain, kv(len(plain)), routed)  # replaces the entry without routing
    hit = cache.lookup([*plain, 3], MIN_TOKENS + 1, need_routing=True)
    assert hit is not None and torch.equal(hit.routed(), routed[: MIN_TOKENS + 1])
    assert not cache.insert(plain, kv(len(plain)))  # a poorer copy does not replace it
    assert len(cache) == 1 and cache.lookup([*plain, 3], 100, need_routing=True) is not None
    with pytest.raises(ValueError, match="routing covers"):
        cache.insert([*plain, 4], kv(len(plain) + 1), routed)


def test_flush_drops_everything_and_advances_the_generation() -> None:
    cache = PrefixCache(1000)
    cache.insert([*BASE, 1], kv(MIN_TOKENS + 1))
    assert cache.flush() == 1
    assert len(cache) == 0 and cache.num_tokens == 0 and cache.nbytes == 0
    assert cache.generation == 1 and cache.lookup([*BASE, 1, 2], 100) is None


def test_common_prefix_length_agrees_with_a_plain_scan() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        limit = rng.randrange(50)
        plain = 0
        while plain < min(limit, len(a), len(b)) and a[plain] == b[plain]:
            plain += 1
        assert common_prefix_length(a, b, limit) == plain


# -------------------------------------------------------------- the engine


def test_the_same_request_twice_feeds_only_its_last_prompt_token(on: Served, off: Served) -> None:
    prompt = tokens(random.Random(1), 40)
    first, again = on.generate(body(prompt)), on.generate(body(prompt))
    assert cached(first) == 0
    # The entry holds prompt + output[:-1]; at least the last prompt token must be fed.
    assert cached(again) == len(prompt) - 1
    assert_same(again, first)
    assert_same(again, off.generate(body(prompt)))
    assert cached(off.generate(body(prompt))) == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_growing_conversation_answers_as_without_the_cache(
    on: Served, off: Served, temperature: float
) -> None:
    """Turn k+1 = prompt_k + output_k + a new suffix; every turn but the first reuses all of turn k."""
    rng = random.Random(f"conversation at temperature {temperature}")
    suffixes = [tokens(rng, 5 + i) for i in range(6)]
    before = on.stats()
    history = tokens(rng, 24)
    fed_with_cache = 0
    for turn, suffix in enumerate(suffixes):
        got = on.generate(body(history, n=5, temperature=temperature))
        assert_same(got, off.generate(body(history, n=5, temperature=temperature)))
        # All of turn k but its last output, which was sampled and never fed.
        assert cached(got) == (len(history) - len(suffixes[turn - 1]) - 1 if turn else 0)
        fed_with_cache += len(history) - cached(got)
        history = history + got["output_ids"] + suffix
    after = on.stats()
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == fed_with_cache
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == len(suffixes) - 1
    assert after["prefix_cache_lookups"] - before["prefix_cache_lookups"] == len(suffixes)


def test_rows_with_different_cached_lengths_prefill_together_with_cold_and_scored_rows(
    on: Served, off: Served
) -> None:
    rng = random.Random(3)
    sessions = [tokens(rng, n) for n in (20, 31, 45)]
    firsts = [on.generate(body(s, n=4)) for s in sessions]
    # Next turns of different lengths (cached 23, 34 and 48 tokens; suffixes of 9, 2 and 5), a new
    # prompt, and a scoring call that reuses its session's prefix up to where its scores start.
    nexts = [
        s + a["output_ids"] + tokens(rng, k) for s, a, k in zip(sessions, firsts, (9, 2, 5), strict=True)
    ]
    score_start = len(sessions[0]) + 2
    bodies = [body(ids, n=6) for ids in nexts] + [
        body(tokens(rng, 19), n=6),
        body(nexts[0], n=0, logprob_start_len=score_start, top_logprobs_num=3),
    ]
    before = on.stats()
    got = on.generate_together(bodies)
    assert on.stats()["prefill_batches"] - before["prefill_batches"] == 1
    assert [cached(a) for a in got] == [23, 34, 48, 0, score_start]
    for a, b in zip(got, off.generate_together(bodies), strict=True):
        assert_same(a, b)
    top_got = got[-1]["meta_info"]["input_top_logprobs"][1:]
    top_want = off.generate(bodies[-1])["meta_info"]["input_top_logprobs"][1:]
    assert [[t[1] for t in row] for row in top_got] == [[t[1] for t in row] for row in top_want]


def test_scored_positions_are_never_taken_from_the_cache(on: Served, off: Served) -> None:
    rng = random.Random(4)
    seq = tokens(rng, 40)
    on.generate(body(seq, n=2))  # caches all of seq
    for start in (0, 10, MIN_TOKENS + 4, len(seq) - 3):
        ask = body(seq, n=2, logprob_start_len=start, top_logprobs_num=2)
        got = on.generate(ask)
        # Positions from `start` on need their logits: only what lies before may come from the cache
        # (and nothing shorter than one index block).
        assert cached(got) == (start if start >= MIN_TOKENS else 0)
        assert_same(got, off.generate(ask))


def test_flush_cache_and_every_weight_change_empty_the_cache(dense_dir: Path, engine_tmp: Path) -> None:
    other = make_tiny_qwen3(engine_tmp / "prefix-other-weights", seed=1)
    served = Served(dense_dir)
    try:
        prompt = tokens(random.Random(5), 30)
        served.generate(body(prompt))
        assert cached(served.generate(body(prompt))) == len(prompt) - 1
        r = served.post("/flush_cache")
        assert r.status_code == 200 and "1 prefix-cache entries dropped" in r.text
        assert served.info()["prefix_cache"]["entries"] == 0
        assert cached(served.generate(body(prompt))) == 0
        # New weights: nothing computed by the old ones is reused, and the answer is the new model's.
        assert served.info()["prefix_cache"]["entries"] == 1
        r = served.post("/update_weights_from_disk", {"model_path": str(other), "weight_version": "1"})
        assert r.status_code == 200, r.text
        assert served.info()["prefix_cache"]["entries"] == 0
        after = served.generate(body(prompt))
        assert cached(after) == 0
        assert after["output_ids"] == greedy_local(load_local(other), prompt, 6)
        # The weights checker writes weights too.
        assert served.info()["prefix_cache"]["entries"] == 1
        r = served.post("/weights_checker", {"action": "reset_tensors"})
        assert r.status_code == 200, r.text
        assert served.info()["prefix_cache"]["entries"] == 0
        assert served.info()["prefix_cache"]["flushes"] == 3
    finally:
        served.close()


@pytest.mark.parametrize("update", [False, True])
def test_a_request_running_across_a_weight_update_is_not_stored(
    dense_dir: Path, engine_tmp: Path, update: bool
) -> None:
    """Its KV would mix both weights; without the update (the control) it is stored."""
    served = Served(dense_dir)
    scheduler = served.engine.scheduler
    try:

        async def go() -> httpx.Response:
            task = asyncio.create_task(
                served._call("POST", "/generate", body(tokens(random.Random(6), 20), n=400))
            )
            while scheduler.counts()[0] == 0:
                await asyncio.sleep(0.001)
            await asyncio.to_thread(scheduler.pause, "in_place")
            assert scheduler.counts() == (1, 0), "the request must still be running at the update"
            if update:  # the same weights again: a write all the same
                update_body = {"model_path": str(dense_dir), "weight_version": "1"}
                r = await served._call("POST", "/update_weights_from_disk", update_body)
                assert r.status_code == 200, r.text
            scheduler.resume()
            return await task

        answer = asyncio.run(go())
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 400
        assert served.info()["prefix_cache"]["entries"] == (0 if update else 1)
    finally:
        served.close()


def test_a_retracted_request_is_prefilled_again_with_the_same_answer(dense_dir: Path, off: Served) -> None:
    served = Served(dense_dir)
    scheduler = served.engine.scheduler
    try:
        rng = random.Random(7)
        prompt = tokens(rng, 30)
        first = served.generate(body(prompt, n=3))
        turn2 = prompt + first["output_ids"] + tokens(rng, 4)
        ask = body(turn2, n=300)

        async def go() -> httpx.Response:
            task = asyncio.create_task(served._call("POST", "/generate", ask))
            while scheduler.counts()[0] == 0:
                await asyncio.sleep(0.001)
            await asyncio.to_thread(scheduler.pause, "retract")
            assert scheduler.counts() == (0, 1), "the request must be retracted mid-generation"
            scheduler.resume()
            return await task

        before = served.stats()
        answer = asyncio.run(go()).json()
        after = served.stats()
        assert after["prefill_requests"] - before["prefill_requests"] == 2  # prefilled, retracted, again
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 2
        assert cached(answer) == len(prompt) + 2  # what its first prefill reused
        assert_same(answer, off.generate(ask))
    finally:
        served.close()


def test_moe_routing_is_stored_with_the_kv_and_returned_for_cached_positions(moe_dir: Path) -> None:
    on, off = Served(moe_dir), Served(moe_dir, prefix_cache_tokens=0)
    try:
        rng = random.Random(8)
        prompt = tokens(rng, 24)
        first = on.generate(body(prompt, n=5, return_routed_experts=True))
        turn2 = prompt + first["output_ids"] + tokens(rng, 4)
        ask = body(turn2, n=5, return_routed_experts=True)
        got = on.generate(ask)
        consumed = len(prompt) + 4
        assert cached(got) == consumed
        assert_same(got, off.generate(ask))
        rows = got["meta_info"]["routed_experts_shape"]
        assert rows[0] == len(turn2) + 5 - 1  # every consumed token, the cached ones included
        row_bytes = rows[1] * rows[2] * 4
        # The cached positions carry exactly the routing turn 1 reported for them.
        old = base64.b64decode(first["meta_info"]["routed_experts"])
        new = base64.b64decode(got["meta_info"]["routed_experts"])
        assert new[: consumed * row_bytes] == old[: consumed * row_bytes]
        # Routing that was not recorded cannot be returned: such an entry is not used...
        other = tokens(rng, 24)
        first = on.generate(body(other, n=5))
        ask = body(other + first["output_ids"], n=2, return_routed_experts=True)
        assert cached(on.generate(ask)) == 0
        # ...but it serves requests that do not ask for routing.
        ask = body(other + first["output_ids"], n=2)
        assert cached(on.generate(ask)) == len(other) + 4
    finally:
        on.close()
        off.close()


def test_models_whose_caches_cannot_be_merged_have_no_prefix_cache(engine_tmp: Path) -> None:
    path = make_tiny_qwen3(
        engine_tmp / "prefix-sliding",
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    served = Served(path)
    try:
        assert served.info()["prefix_cache"] is None and served.info()["continuous_batching"] is False
        prompt = tokens(random.Random(9), 30)
        served.generate(body(prompt))
        assert cached(served.generate(body(prompt))) == 0
        assert served.stats()["prefix_cache_lookups"] == 0
        with pytest.raises(ValueError, match="cache_is_mergeable"):
            Scheduler(served.engine.runner, max_batch_size=4, mergeable=False, prefix_cache=PrefixCache(100))
    finally:
        served.close()


def test_data_parallel_rank_and_server_info(on: Served) -> None:
    info = on.info()
    assert info["dp_size"] == 1
    assert info["prefix_cache"]["max_tokens"] == 65536
    assert {"prefix_cache_hits", "prefix_cache_lookups", "cached_tokens", "prefilled_tokens"} <= set(
        info["batch_stats"]
    )
    prompt = tokens(random.Random(10), 20)
    for rank in (None, 0):
        assert on.generate({**body(prompt, n=1), "data_parallel_rank": rank})["output_ids"]
    r = on.post("/generate", {**body(prompt, n=1), "data_parallel_rank": 1})
    assert r.status_code == 400
    assert "data_parallel_rank 1 does not exist" in r.json()["message"] and "dp_size 1" in r.json()["message"]
    with pytest.raises(ValueError, match="prefix_cache_tokens must be >= 0"):
        EmbeddedEngine(EngineOptions(model_path="unused", prefix_cache_tokens=-1))
