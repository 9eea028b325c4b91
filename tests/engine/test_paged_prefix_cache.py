"""The paged path's prefix cache (``paged/radix.py``): the radix tree of KV blocks on its own, then on
the CPU engine: a conversation's hits answer exactly as misses, block accounting never leaks under
preemption, aborts, pauses and flushes, every weight change and ``/flush_cache`` empty it, and
cached blocks are evicted before a running request is retracted."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.helpers import VOCAB, full_forward_logprobs, generate_in_process, load_local, make_tiny_qwen3
from miles.engines.embedded.paged.allocator import BlockAllocator
from miles.engines.embedded.paged.radix import RadixCache
from miles.engines.embedded.sampler import GenRequest

BS = 4  # tokens per block, in the tree tests and the engines below
TOL = 1e-5  # float32 on the CPU: cached and recomputed KV differ by rounding only


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------ the tree alone


def _leave(tree: RadixCache, alloc: BlockAllocator, tokens: list[int], blocks: list[int]) -> int:
    """A request holding ``blocks`` for ``tokens`` leaves: its full blocks go in, then it lets go."""
    added = tree.insert(tokens, blocks[: len(tokens) // BS])
    alloc.release(blocks)
    return added


def test_match_takes_the_longest_prefix_in_whole_blocks_within_the_limit() -> None:
    alloc = BlockAllocator(17, BS)
    tree = RadixCache(alloc, 1000)
    seq = list(range(1, 15))  # 3 full blocks and 2 tokens
    own = alloc.allocate(4)
    assert tree.insert(seq, own[:3]) == 3
    assert [alloc.refcount(b) for b in own] == [2, 2, 2, 1]  # the tree's reference plus the request's
    alloc.release(own)
    assert [alloc.refcount(b) for b in own[:3]] == [1, 1, 1] and alloc.num_free == 16 - 3
    assert tree.match(seq, 14) == own[:3]
    assert tree.match(seq, 12) == own[:3]
    assert tree.match(seq, 11) == own[:2]  # the caller's limit (the last fed token, scored positions)
    assert tree.match([*seq[:12], 99, 98], 100) == own[:3]
    assert tree.match([*seq[:6], 99, 99, 99, 99], 100) == own[:1]  # diverges inside the second block
    assert tree.match([99, *seq], 100) == []
    assert tree.match(seq[:3], 100) == []  # shorter than a block
    assert tree.num_tokens == 12 and tree.describe()["entries"] == 3
    tree.check()
    alloc.check()


def test_blocks_already_cached_for_the_same_tokens_are_not_taken_twice() -> None:
    alloc = BlockAllocator(17, BS)
    tree = RadixCache(alloc, 1000)
    seq = list(range(1, 9))
    first = alloc.allocate(2)
    assert _leave(tree, alloc, seq, first) == 2
    copy = alloc.allocate(2)  # the same prefix computed by a request that missed (it ran concurrently)
    assert _leave(tree, alloc, seq, copy) == 0
    assert all(alloc.refcount(b) == 0 for b in copy)  # its copy went back to the free list
    # A next turn holds the cached blocks (shared) and two of its own: only those two are new.
    longer = [*seq, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    shared = tree.match(longer, len(longer) - 1)
    assert shared == first
    alloc.share(shared)
    own = alloc.allocate(3)
    assert _leave(tree, alloc, longer, shared + own) == 2
    assert [alloc.refcount(b) for b in first + own] == [1, 1, 1, 1, 0]
    assert tree.match(longer, 100) == first + own[:2]
    with pytest.raises(ValueError, match="already cached for other tokens"):
        tree.insert([50, 51, 52, 53], [first[0]])
    tree.check()
    alloc.check()


def test_eviction_frees_least_recently_used_leaves_only_the_tree_holds() -> None:
    alloc = BlockAllocator(17, BS)
    tree = RadixCache(alloc, 1000)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    path = [4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6]
    held = {}
    for seq in (path, a, b, c):
        blocks = alloc.allocate(len(seq) // BS)
        held[tuple(seq)] = blocks
        _leave(tree, alloc, seq, blocks)
    assert tree.match(a, 4) and tree.match(path, 12)  # used again: b and c are now the oldest
    free = alloc.num_free
    assert tree.evict(1) == 1 and tree.match(b, 4) == [] and alloc.num_free == free + 1
    # A running request holds a's block: eviction passes it by and takes c, then path from its leaf up.
    in_use = tree.match(a, 4)
    alloc.share(in_use)
    assert tree.evict(2) == 2
    assert tree.match(c, 4) == [] and tree.match(path, 12) == held[tuple(path)][:2]
    assert tree.evict(10) == 2  # the rest of path; a stays (its request still holds it)
    assert tree.match(a, 4) == in_use and len(tree) == 1
    alloc.release(in_use)
    assert tree.evict(10) == 1 and len(tree) == 0 and alloc.num_free == 16
    assert tree.evictions == 6
    tree.check()
    alloc.check()


def test_the_size_bound_drops_least_recent_blocks_even_if_a_request_holds_them() -> None:
    alloc = BlockAllocator(17, BS)
    tree = RadixCache(alloc, 2 * BS + 3)  # rounded down to 2 blocks
    assert tree.describe()["max_tokens"] == 2 * BS
    long = list(range(1, 13))
    blocks = alloc.allocate(3)
    assert _leave(tree, alloc, long, blocks) == 2  # beyond the bound: left out
    assert alloc.refcount(blocks[2]) == 0
    other = alloc.allocate(1)
    alloc.share(other)  # a second holder: another request runs on this block
    assert _leave(tree, alloc, [9] * 4, other) == 1
    # (Membership, not match: a match would count as a use.)
    assert len(tree) == 2 and blocks[0] in tree and blocks[1] not in tree  # long's leaf was the oldest
    _leave(tree, alloc, [8] * 4, alloc.allocate(1))
    assert len(tree) == 2 and blocks[0] not in tree and other[0] in tree  # then long's first block
    _leave(tree, alloc, [7] * 4, alloc.allocate(1))
    assert other[0] not in tree and alloc.refcount(other[0]) == 1  # dropped; its other holder keeps it
    alloc.release(other)
    assert tree.evictions == 3 and alloc.num_free == 16 - 2
    tree.check()
    alloc.check()


def test_flush_drops_the_trees_references_and_advances_the_generation() -> None:
    alloc = BlockAllocator(17, BS)
    tree = RadixCache(alloc, 1000)
    seq = list(range(1, 13))
    _leave(tree, alloc, seq, alloc.allocate(3))
    running = tree.match(seq, 8)
    alloc.share(running)
    assert tree.flush() == 3
    assert len(tree) == 0 and tree.generation == 1 and tree.flushes == 1
    assert tree.match(seq, 100) == []
    assert [alloc.refcount(b) for b in running] == [1, 1]  # the request keeps its blocks
    alloc.release(running)
    assert alloc.num_free == 16
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        RadixCache(alloc, 0)


def test_namespaces_keep_adapters_apart() -> None:
    """Each LoRA adapter (a namespace; None is the base) has a tree of its own: the same tokens cached
    under two namespaces are two sets of blocks, and dropping one namespace leaves the others."""
    alloc = BlockAllocator(17, BS)
    tree = RadixCache(alloc, 1000)
    seq = list(range(1, 13))
    base, adapter = alloc.allocate(3), alloc.allocate(3)
    assert tree.insert(seq, base) == 3
    assert tree.match(seq, 12, "a") == []  # the base's KV is not the adapter's
    assert tree.insert(seq, adapter, "a") == 3  # the same tokens, other blocks
    alloc.release(base + adapter)
    assert tree.match(seq, 12) == base and tree.match(seq, 12, "a") == adapter
    assert tree.match(seq, 12, "b") == []
    assert tree.describe()["adapter_trees"] == 1
    generation = tree.generation
    assert tree.flush_namespace("a") == 3
    assert tree.generation == generation + 1  # requests of that adapter started before do not insert
    assert tree.match(seq, 12, "a") == [] and tree.match(seq, 12) == base
    assert all(alloc.refcount(b) == 0 for b in adapter) and alloc.num_free == 16 - 3
    assert tree.flush_namespace("nothing") == 0
    tree.check()
    assert tree.evict(3) == 3 and alloc.num_free == 16  # a namespace's root is never evicted
    tree.check()
    alloc.check()


def test_random_operations_keep_the_tree_and_the_allocator_consistent() -> None:
    """Requests admitted with their cached prefix (under the base or one of two adapters), leaving,
    evictions and flushes (of all or of one adapter), against a model of the pool: every matched block
    holds the KV of exactly the request's prefix under the request's adapter, and every reference is
    the tree's or a live request's."""
    rng = random.Random(0)
    alloc = BlockAllocator(41, BS)
    tree = RadixCache(alloc, 30 * BS)
    systems = [[rng.randrange(3) for _ in range(rng.choice((0, 4, 8, 9)))] for _ in range(4)]
    # block -> the adapter and token prefix its KV was computed for
    written: dict[int, tuple[str | None, tuple[int, ...]]] = {}
    live: list[tuple[list[int], list[int], str | None]] = []
    namespaces = [None, None, "a", "b"]
    for step in range(4000):
        op = rng.random()
        if op < 0.4:
            ns = rng.choice(namespaces)
            seq = rng.choice(systems) + [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            matched = tree.match(seq, len(seq) - 1, ns)
            assert len(matched) * BS <= len(seq) - 1
            for i, b in enumerate(matched):
                assert written[b] == (ns, tuple(seq[: (i + 1) * BS]))
            alloc.share(matched)
            need = alloc.blocks_for(len(seq)) - len(matched)
            if need > alloc.num_free:
                tree.evict(need - alloc.num_free)
            if need > alloc.num_free:
                alloc.release(matched)
                continue
            new = alloc.allocate(need)
            for j, b in enumerate(new):
                written[b] = (ns, tuple(seq[: (len(matched) + j + 1) * BS]))
            live.append((seq, matched + new, ns))
        elif op < 0.8 and live:
            seq, blocks, ns = live.pop(rng.randrange(len(live)))
            tree.insert(seq, blocks[: len(seq) // BS], ns)
            alloc.release(blocks)
        elif op < 0.83:
            tree.flush()
        elif op < 0.86:
            tree.flush_namespace(rng.choice(["a", "b"]))
        elif op < 0.95:
            tree.evict(rng.randint(1, 5))
        tree.check()
        alloc.check()
        holders = [b for _, blocks, _ in live for b in blocks]
        for b in range(1, alloc.num_blocks):
            assert alloc.refcount(b) == (b in tree) + holders.count(b), (step, b)
    assert tree.evictions > 0 and tree.flushes > 0
    for _, blocks, _ in live:
        alloc.release(blocks)
    tree.flush()
    assert alloc.num_free == alloc.num_blocks - 1


def test_a_heap_of_stale_entries_is_rebuilt() -> None:
    alloc = BlockAllocator(5, BS)
    tree = RadixCache(alloc, 1000)
    _leave(tree, alloc, [1] * 4, alloc.allocate(1))
    for _ in range(500):  # every match of a leaf pushes an entry; the old ones go stale
        tree.match([1] * 4, 4)
    assert len(tree._heap) <= 2 * len(tree) + 65
    assert tree.evict(1) == 1 and alloc.num_free == 4


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def model_dir(engine_tmp: Path) -> Path:
    return make_tiny_qwen3(engine_tmp / "paged-radix-model", seed=3)


def _paged(model_dir: Path, **options: Any) -> Any:
    from miles.engines.embedded.engine import EmbeddedEngine, EngineOptions

    opts: dict[str, Any] = dict(device="cpu", dtype="float32", kv_cache="paged", kv_tokens=512, block_size=BS)
    opts.update(options)
    engine = EmbeddedEngine(EngineOptions(model_path=str(model_dir), **opts))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def on(model_dir: Path) -> Iterator[Any]:
    engine = _paged(model_dir)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def off(model_dir: Path) -> Iterator[Any]:
    engine = _paged(model_dir, prefix_cache_tokens=0)
    yield engine
    engine.stop()


def _generate(engine: Any, prompts: list[list[int]], **params: Any) -> list[Any]:
    return generate_in_process(engine, prompts, **{"max_new_tokens": 6, "timeout": 120, **params})


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _assert_same(got: Any, want: Any) -> None:
    assert got.output_ids == want.output_ids
    assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=TOL)


def _check_accounting(engine: Any) -> None:
    """Under the step lock: every block's references are the tree's plus the running requests'."""
    scheduler = engine.scheduler
    alloc = engine.paged.allocator
    with scheduler.step_lock:
        alloc.check()
        tree = scheduler.radix
        if tree is not None:
            tree.check()
        holders = [b for state in scheduler._states.values() for b in state.blocks]
        for b in range(1, alloc.num_blocks):
            cached = tree is not None and b in tree
            assert alloc.refcount(b) == cached + holders.count(b), b


def _assert_all_free(engine: Any) -> None:
    _check_accounting(engine)
    alloc = engine.paged.allocator
    with engine.scheduler.step_lock:
        engine.scheduler.flush_prefix_cache()
        assert alloc.num_free == alloc.num_blocks - 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_conversation_hits_and_answers_as_without_the_cache(
    on: Any, off: Any, model_dir: Path, temperature: float
) -> None:
    """Turn k+1 = prompt_k + output_k + a suffix: it takes every complete block turn k left in the pool."""
    rng = random.Random(f"paged conversation {temperature}")
    history = _tokens(rng, 23)
    before = dict(on.scheduler.stats)
    n = 6
    expected_cached = 0
    for turn in range(5):
        [got] = _generate(on, [history], temperature=temperature, seed=4, max_new_tokens=n)
        [want] = _generate(off, [history], temperature=temperature, seed=4, max_new_tokens=n)
        _assert_same(got, want)
        assert got.cached_tokens == expected_cached
        # Turn k consumed its prompt and all but its last output; its complete blocks stay cached.
        expected_cached = (len(history) + n - 1) // BS * BS
        history = history + got.output_ids + _tokens(rng, 1 + turn)
    assert got.output_logprobs == pytest.approx(
        full_forward_logprobs(load_local(model_dir), history[: -5 - n], got.output_ids, temperature), abs=TOL
    )
    stats = on.scheduler.stats
    assert stats["prefix_cache_lookups"] - before["prefix_cache_lookups"] == 5
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == 4
    assert off.scheduler.stats["prefix_cache_lookups"] == 0 and off.server_info()["prefix_cache"] is None
    _check_accounting(on)


def test_sessions_sharing_a_system_prompt_share_its_blocks(on: Any, off: Any) -> None:
    rng = random.Random(1)
    system = _tokens(rng, 10)  # two full blocks and two tokens
    _generate(on, [system + _tokens(rng, 3)], max_new_tokens=1)
    prompts = [system + _tokens(rng, 2 + i) for i in range(4)]
    n = 100  # long enough to still be running when the test looks
    scheduler = on.scheduler
    scheduler.pause("in_place")  # queued together, then admitted by one step
    reqs = [generate_later(on, p, max_new_tokens=n) for p in prompts]
    scheduler.resume()
    while not all(r.output_ids for r in reqs):
        time.sleep(0.0005)
    scheduler.pause("in_place")
    try:
        if all(r.finish is None for r in reqs):  # (a starved test thread may look too late)
            shared = reqs[0].prompt_ids[:8]
            blocks = [b for state in scheduler._states.values() for b in state.blocks[:2]]
            assert len(set(blocks)) == 2  # every request runs on the same two blocks
            assert [on.paged.allocator.refcount(b) for b in set(blocks)] == [1 + len(prompts)] * 2
            assert scheduler.radix.match(shared, 8) == blocks[:2]
        _check_accounting(on)
    finally:
        scheduler.resume()
    for r in reqs:
        assert r.done.wait(120)
    assert [r.cached_tokens for r in reqs] == [8] * 4
    for got, want in zip(reqs, _generate(off, prompts, max_new_tokens=n), strict=True):
        _assert_same(got, want)
    _check_accounting(on)


def test_random_workload_with_preemption_aborts_pauses_and_flushes_never_leaks(
    model_dir: Path, off: Any
) -> None:
    """A small pool (24 blocks) and six rows: decodes run out of blocks, evict and retract; requests
    are aborted, the cache flushed and the scheduler paused at random. The accounting holds at every
    check, finished requests answer as a roomy engine without the cache does, aborted ones with a
    prefix of that answer, and every block is free at the end."""
    engine = _paged(model_dir, kv_tokens=96, max_batch_size=6)
    rng = random.Random(2)
    systems = [_tokens(rng, k) for k in (8, 9, 4)]
    plans: list[tuple[list[int], int, int]] = []  # (prompt, max_new_tokens, seed)
    for i in range(36):
        prompt = rng.choice(systems) + _tokens(rng, rng.randrange(2, 20))
        if plans and rng.random() < 0.4:  # a later turn of an earlier prompt
            prompt = plans[rng.randrange(len(plans))][0] + _tokens(rng, rng.randrange(1, 6))
        plans.append((prompt[:60], rng.randrange(4, 24), i))
    scheduler = engine.scheduler
    reqs: list[GenRequest] = []
    done = threading.Semaphore(0)
    try:
        for k, (prompt, n, seed) in enumerate(plans):
            req = engine.make_request(
                input_ids=prompt, rid=f"r{k}", max_new_tokens=n, temperature=0.9, top_p=1.0, top_k=-1,
                stop_token_ids=[], seed=seed, ignore_eos=True, return_logprob=True, return_routed_experts=False,
            )  # fmt: skip
            req.on_done = lambda r: done.release()
            reqs.append(req)
            scheduler.submit(req)
            for _ in range(rng.randrange(0, 3)):
                time.sleep(0.002)
                op = rng.random()
                if op < 0.15:
                    scheduler.abort(f"r{rng.randrange(k + 1)}")
                elif op < 0.3:
                    engine.flush_cache()
                elif op < 0.4:
                    scheduler.pause("retract")
                    _check_accounting(engine)
                    scheduler.resume()
                _check_accounting(engine)
        for _ in reqs:
            assert done.acquire(timeout=300)
        stats = scheduler.stats
        assert stats["retractions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["errors"] == 0
        assert scheduler.radix.evictions > 0
        _assert_all_free(engine)
    finally:
        engine.stop()
    finished = [r for r in reqs if r.finish is not None and r.finish["type"] == "length"]
    assert len(finished) >= len(reqs) // 2
    want = [
        generate_later(off, r.prompt_ids, max_new_tokens=r.max_new_tokens, temperature=0.9, seed=r.seed)
        for r in reqs
    ]
    for got, ref in zip(reqs, want, strict=True):
        assert ref.done.wait(300)
        k = len(got.output_ids)
        assert got.output_ids == ref.output_ids[:k], got.rid
        assert got.output_logprobs == pytest.approx(ref.output_logprobs[:k], abs=TOL), got.rid


def test_a_retracted_request_takes_its_own_blocks_back(on: Any, off: Any) -> None:
    scheduler = on.scheduler
    prompt = _tokens(random.Random(3), 14)
    req = generate_later(on, prompt, max_new_tokens=80)
    while len(req.output_ids) < 12:
        time.sleep(0.0005)
    before = dict(scheduler.stats)
    scheduler.pause("retract")
    assert scheduler.counts() == (0, 1)
    scheduler.resume()
    assert req.done.wait(120)
    stats = scheduler.stats
    assert stats["retractions"] - before["retractions"] == 1
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == 1
    assert stats["cached_tokens"] - before["cached_tokens"] >= 14 + 12 - 1 - BS
    assert req.cached_tokens == 0  # what its first prefill took
    [want] = _generate(off, [prompt], max_new_tokens=80)
    _assert_same(req, want)


def generate_later(engine: Any, prompt: list[int], **params: Any) -> Any:
    """Submit one greedy request; returns it at once (``.done`` is set when it is answered)."""
    from engine.helpers import greedy_request

    req = greedy_request(engine, prompt, **params)
    req.done = threading.Event()  # type: ignore[attr-defined]
    req.on_done = lambda r: r.done.set()
    engine.scheduler.submit(req)
    return req


def test_cached_blocks_are_evicted_before_a_running_request_is_retracted(model_dir: Path, off: Any) -> None:
    engine = _paged(model_dir, kv_tokens=64)  # 16 blocks
    try:
        rng = random.Random(4)
        firsts = [_tokens(rng, 16) for _ in range(3)]
        for prompt in firsts:  # one after the other: each leaves 5 complete blocks (23 tokens consumed)
            _generate(engine, [prompt], max_new_tokens=8)
        tree = engine.scheduler.radix
        assert len(tree) == 15 and engine.paged.allocator.num_free == 1
        # Two requests of up to 12 + 16 = 28 tokens (7 blocks each): they fit once the cache is evicted.
        pair = [_tokens(rng, 12) for _ in range(2)]
        got = _generate(engine, pair, max_new_tokens=16)
        assert engine.scheduler.stats["retractions"] == 0
        assert tree.evictions == 13
        for a, b in zip(got, _generate(off, pair, max_new_tokens=16), strict=True):
            _assert_same(a, b)
        # Least recently used first: of the three sessions only the last one's first two blocks are left.
        [third, first] = _generate(engine, [firsts[2], firsts[0]], max_new_tokens=1)
        assert third.cached_tokens == 2 * BS and first.cached_tokens == 0
        _assert_all_free(engine)
    finally:
        engine.stop()


def test_weight_updates_flush_and_a_request_spanning_one_is_not_cached(
    model_dir: Path, engine_tmp: Path
) -> None:
    engine = _paged(model_dir)
    other = load_local(make_tiny_qwen3(engine_tmp / "paged-radix-seed8", seed=8))
    tensors = {k: v.detach().contiguous() for k, v in other.named_parameters()}
    try:
        prompt = _tokens(random.Random(5), 21)
        _generate(engine, [prompt])
        [hit] = _generate(engine, [prompt])
        assert hit.cached_tokens == 20
        engine.weights.update(lambda: tensors, "1")
        info = engine.server_info()["prefix_cache"]
        assert info["entries"] == 0 and info["flushes"] == 1
        [after] = _generate(engine, [prompt])
        assert after.cached_tokens == 0  # nothing the old weights computed is reused
        assert after.output_logprobs == pytest.approx(
            full_forward_logprobs(other, prompt, after.output_ids, 0.0), abs=TOL
        )
        # A request running across an update: its KV mixes both weights, so it is not cached.
        engine.flush_cache()
        long = generate_later(engine, _tokens(random.Random(6), 13), max_new_tokens=200)
        while len(long.output_ids) < 5:
            time.sleep(0.0005)
        engine.weights.update(lambda: tensors, "2")
        assert long.done.wait(120) and long.output_versions[-1] == 2
        assert len(engine.scheduler.radix) == 0
        _assert_all_free(engine)
    finally:
        engine.stop()


def test_flush_cache_endpoint_server_info_and_memory_release(model_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from miles.engines.embedded.receivers import InstalledReceivers
    from miles.engines.embedded.server import create_app

    engine = _paged(model_dir)
    try:
        client = TestClient(create_app(engine, InstalledReceivers({}, {})))
        info = client.get("/get_server_info").json()["prefix_cache"]
        assert info["kind"] == "radix" and info["max_tokens"] == engine.paged.allocator.capacity_tokens
        prompt = _tokens(random.Random(7), 18)
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}

        def cached() -> int:
            r = client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return int(r.json()["meta_info"]["cached_tokens"])

        assert cached() == 0
        assert cached() == 16
        blocks = len(engine.scheduler.radix)
        r = client.post("/flush_cache")
        assert r.status_code == 200 and f"{blocks} prefix-cache entries dropped" in r.text
        assert client.get("/get_server_info").json()["prefix_cache"]["entries"] == 0
        assert cached() == 0
        # A memory release flushes the cache with the pool; a request after the resume starts cold.
        assert len(engine.scheduler.radix) > 0
        assert client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert len(engine.scheduler.radix) == 0
        assert client.post("/resume_memory_occupation").status_code == 200
        assert cached() == 0
        assert cached() == 16
    finally:
        engine.stop()


def test_prefix_cache_tokens_bounds_or_disables_the_cache(model_dir: Path) -> None:
    small = _paged(model_dir, prefix_cache_tokens=10)
    try:
        assert small.server_info()["prefix_cache"]["max_tokens"] == 8  # whole blocks
        prompt = _tokens(random.Random(8), 20)
        _generate(small, [prompt])
        assert len(small.scheduler.radix) == 2
        [again] = _generate(small, [prompt])
        assert again.cached_tokens == 8
    finally:
        small.stop()
    disabled = _paged(model_dir, prefix_cache_tokens=0)
    try:
        assert disabled.scheduler.radix is None and disabled.server_info()["prefix_cache"] is None
        _generate(disabled, [prompt])
        [again] = _generate(disabled, [prompt])
        assert again.cached_tokens == 0
        assert disabled.paged.allocator.num_free == disabled.paged.allocator.num_blocks - 1
    finally:
        disabled.stop()


def test_rows_returning_routed_experts_do_not_take_cached_blocks(on: Any) -> None:
    # The tree keeps no routing. (A dense model: the request is built here, since make_request refuses
    # return_routed_experts without MoE routers; the scheduler itself does not look at the model.)
    prompt = _tokens(random.Random(9), 17)
    _generate(on, [prompt])
    lookups = on.scheduler.stats["prefix_cache_lookups"]
    done = threading.Event()
    routed = GenRequest(
        rid="routed", prompt_ids=prompt, max_new_tokens=3, temperature=0.0, return_routed_experts=True
    )
    routed.on_done = lambda r: done.set()
    on.scheduler.submit(routed)
    assert done.wait(60) and len(routed.output_ids) == 3
    assert routed.cached_tokens == 0 and on.scheduler.stats["prefix_cache_lookups"] == lookups
    [plain] = _generate(on, [prompt])
    assert plain.cached_tokens == 16
