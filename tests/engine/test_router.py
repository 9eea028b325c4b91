"""The session-affinity router: stickiness, placement by load, missing keys, DP ranks, concurrency.

The router only does bookkeeping, so most tests give it plain objects as engines; the last
ones send its routes through the real client to the SGLang contract fake (the DP rank must
reach ``/generate``) and to a running embedded engine.
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest

from engine.sglang_fake import FakeSGLang
from miles.engines.client import SGLangClient, SyncEngineClient, generate_call
from miles.engines.launchers import EmbeddedLauncher
from miles.engines.router import Route, Router, RoutingError, RoutingKeyMissing, engine_dp_sizes
from miles.errors import ConfigError, EngineError, MilesError
from miles.interfaces import EngineSpec
from miles.types import SamplingParams


class Engine:
    """A stand-in engine: the router never calls it, it only hands it out in routes."""

    def __init__(self, name: str) -> None:
        self.url = name

    def __repr__(self) -> str:
        return f"Engine({self.url})"


def fleet(n: int) -> list[Engine]:
    return [Engine(f"e{i}") for i in range(n)]


def active(router: Router) -> list[int]:
    m = router.metrics()
    return [int(m[f"router/engine{i}/active"]) for i in range(len(router.engines))]


def keys(router: Router) -> list[int]:
    m = router.metrics()
    return [int(m[f"router/engine{i}/keys"]) for i in range(len(router.engines))]


# ------------------------------------------------------------------ stickiness and placement


def test_a_key_stays_on_its_engine_whatever_the_load() -> None:
    router = Router(fleet(3))
    first = router.acquire("s1", sticky=True)
    # Even with its engine the busiest by far, the session's later turns follow its prefix.
    busy = [router.acquire("s1", sticky=True) for _ in range(5)]
    assert {r.engine_index for r in busy} == {first.engine_index}
    assert router.route("s1", sticky=True) == first
    assert router.placement("s1") == first
    assert active(router)[first.engine_index] == 6


def test_new_keys_go_to_the_least_active_engine() -> None:
    router = Router(fleet(3))
    held = [router.acquire(None, sticky=False) for _ in range(3)]  # single-turn work, one per engine
    router.release(held[0])
    assert active(router) == [0, 1, 1]
    assert router.acquire("new", sticky=True).engine_index == 0
    assert active(router) == [1, 1, 1]
    # Equal load: fewer bound keys wins (engine 0 holds "new"), then fewer requests routed.
    assert router.acquire("newer", sticky=True).engine_index == 1
    assert router.acquire("newest", sticky=True).engine_index == 2


def test_idle_fleet_spreads_new_keys_evenly_and_in_order() -> None:
    router = Router(fleet(4))
    placed = [router.route(f"s{i}", sticky=True).engine_index for i in range(10)]
    assert placed == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert keys(router) == [3, 3, 2, 2]


def test_sticky_request_without_a_key_fails_and_never_falls_back() -> None:
    router = Router(fleet(2))
    for missing in (None, ""):
        with pytest.raises(RoutingKeyMissing, match="needs a routing key") as err:
            router.acquire(missing, sticky=True)
        assert isinstance(err.value, MilesError)
    with pytest.raises(RoutingKeyMissing):
        router.route(None, sticky=True)
    # The load baseline checks keys the same way: switching policy does not hide the bug.
    with pytest.raises(RoutingKeyMissing):
        Router(fleet(2), policy="load").acquire(None, sticky=True)
    assert router.metrics()["router/requests_routed"] == 0 and active(router) == [0, 0]


def test_a_key_on_a_non_sticky_request_is_refused() -> None:
    router = Router(fleet(2))
    with pytest.raises(RoutingError, match="pass sticky=True"):
        router.acquire("s1", sticky=False)
    with pytest.raises(RoutingError, match="must be a string"):
        router.acquire(42, sticky=True)  # type: ignore[arg-type]
    assert router.placement("s1") is None


def test_forget_releases_the_key() -> None:
    router = Router(fleet(2))
    assert router.route("a", sticky=True).engine_index == 0
    assert router.route("b", sticky=True).engine_index == 1
    assert router.forget("a") is True
    assert router.forget("a") is False and router.forget("never") is False
    assert router.placement("a") is None and keys(router) == [0, 1]
    # Placed afresh, by load: engine 1 is busy with "b".
    router.acquire("b", sticky=True)
    assert router.route("a", sticky=True).engine_index == 0
    assert router.metrics()["router/keys"] == 2


def test_forgetting_a_key_with_a_request_in_flight_still_releases_that_request() -> None:
    router = Router(fleet(2))
    route = router.acquire("a", sticky=True)
    router.forget("a")
    router.release(route)
    assert active(router) == [0, 0]


def test_non_sticky_requests_route_by_load() -> None:
    router = Router(fleet(3))
    router.route("s", sticky=True)  # a bound key on engine 0 makes it the last choice among equals
    held = [router.acquire(None, sticky=False) for _ in range(6)]
    assert [r.engine_index for r in held] == [1, 2, 0, 1, 2, 0]
    for r in held[:2]:
        router.release(r)
    assert router.acquire(None, sticky=False).engine_index == 1
    assert router.acquire(None, sticky=False).engine_index == 2


def test_idle_fleet_takes_single_turn_work_in_turn() -> None:
    router = Router(fleet(3))
    seen = []
    for _ in range(6):
        route = router.acquire(None, sticky=False)
        seen.append(route.engine_index)
        router.release(route)  # always idle again: the routed count breaks the tie
    assert seen == [0, 1, 2, 0, 1, 2]


def test_load_policy_ignores_keys() -> None:
    router = Router(fleet(2), policy="load")
    first = router.acquire("s1", sticky=True)
    second = router.acquire("s1", sticky=True)
    assert (first.engine_index, second.engine_index) == (0, 1)
    assert router.placement("s1") is None and router.metrics()["router/keys"] == 0
    assert router.forget("s1") is False


# ------------------------------------------------------------------ data-parallel ranks


def test_dp_ranks_place_and_stick_per_rank() -> None:
    router = Router(fleet(2), dp_sizes=[2, 1])
    routes = {k: router.acquire(k, sticky=True) for k in ("a", "b", "c", "d")}
    assert {k: (r.engine_index, r.dp_rank) for k, r in routes.items()} == {
        "a": (0, 0),
        "b": (1, None),  # single-rank engine: no rank is named (nothing extra is sent)
        "c": (0, 1),  # engine 0's rank 0 is busy with "a"
        "d": (1, None),
    }
    assert router.acquire("c", sticky=True).dp_rank == 1
    m = router.metrics()
    assert m["router/engine0/dp0/active"] == 1 and m["router/engine0/dp1/active"] == 2
    assert m["router/engine0/active"] == 3 and "router/engine1/dp0/active" not in m
    router.release(routes["c"])
    router.release(routes["c"])  # c's second request: the same route
    # Non-sticky work goes to the least active engine, then its least active rank.
    route = router.acquire(None, sticky=False)
    assert (route.engine_index, route.dp_rank) == (0, 1)


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least one engine"):
        Router([])
    with pytest.raises(ConfigError, match="policy 'random'"):
        Router(fleet(1), policy="random")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="2 entries for 3 engines"):
        Router(fleet(3), dp_sizes=[1, 1])
    with pytest.raises(ConfigError, match=r"dp_sizes\[1\] must be an integer >= 1, got 0"):
        Router(fleet(2), dp_sizes=[1, 0])


def test_release_checks_the_route() -> None:
    router = Router(fleet(2), dp_sizes=[1, 2])
    route = router.acquire(None, sticky=False)
    router.release(route)
    with pytest.raises(RoutingError, match="released twice"):
        router.release(route)
    with pytest.raises(RoutingError, match="does not come from this router"):
        router.release(Route(0, Engine("elsewhere")))
    with pytest.raises(RoutingError, match="which has 2 rank"):
        router.release(Route(1, router.engines[1], dp_rank=5))


# ------------------------------------------------------------------ concurrency


def test_request_counts_until_the_block_exits_errors_included() -> None:
    router = Router(fleet(2))

    async def go() -> None:
        async with router.request("s", sticky=True) as route:
            assert active(router)[route.engine_index] == 1
        with pytest.raises(ValueError, match="boom"):
            async with router.request("s", sticky=True):
                raise ValueError("boom")
        with pytest.raises(asyncio.CancelledError):
            async with router.request(None, sticky=False):
                raise asyncio.CancelledError

    asyncio.run(go())
    assert active(router) == [0, 0]
    assert router.metrics()["router/requests_routed"] == 3


def test_many_threads_keep_keys_sticky_and_counts_exact() -> None:
    router = Router(fleet(4), dp_sizes=[1, 2, 1, 3])
    seen: dict[str, set[tuple[int, int | None]]] = {}
    seen_lock = threading.Lock()
    peak = [0]
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        rng = random.Random(t)
        start.wait()
        for _ in range(300):
            key = f"s{rng.randrange(40)}" if rng.random() < 0.8 else None
            route = router.acquire(key, sticky=key is not None)
            with seen_lock:
                if key is not None:
                    seen.setdefault(key, set()).add((route.engine_index, route.dp_rank))
                peak[0] = max(peak[0], int(router.metrics()["router/active"]))
            router.release(route)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(len(places) == 1 for places in seen.values()), seen
    m = router.metrics()
    assert m["router/active"] == 0 and m["router/requests_routed"] == 8 * 300
    assert m["router/keys"] == len(seen) and 1 <= peak[0] <= 8
    assert sum(keys(router)) == len(seen)


def test_concurrent_tasks_spread_new_sessions_by_active_requests() -> None:
    router = Router(fleet(4))

    async def session(key: str, gate: asyncio.Event, places: list[int]) -> None:
        for _ in range(3):
            async with router.request(key, sticky=True) as route:
                places.append(route.engine_index)
                await gate.wait()

    async def go() -> dict[str, list[int]]:
        gate = asyncio.Event()
        places: dict[str, list[int]] = {f"s{i}": [] for i in range(12)}
        tasks = [asyncio.create_task(session(k, gate, p)) for k, p in places.items()]
        await asyncio.sleep(0.01)
        # Every session's first turn is in flight at once: three per engine.
        assert active(router) == [3, 3, 3, 3]
        gate.set()
        await asyncio.gather(*tasks)
        return places

    places = asyncio.run(go())
    assert all(len(set(p)) == 1 and len(p) == 3 for p in places.values())
    assert keys(router) == [3, 3, 3, 3] and active(router) == [0, 0, 0, 0]


# ------------------------------------------------------------------ on the wire


def test_data_parallel_rank_reaches_generate_only_when_named() -> None:
    params = SamplingParams(max_new_tokens=2)
    assert "data_parallel_rank" not in generate_call([1, 2], params).body
    assert generate_call([1, 2], params, data_parallel_rank=0).body["data_parallel_rank"] == 0
    for bad in (-1, True, 1.0):
        with pytest.raises(EngineError, match="data_parallel_rank must be an integer >= 0"):
            generate_call([1, 2], params, data_parallel_rank=bad)  # type: ignore[arg-type]
    with FakeSGLang() as fake:
        engines = [SGLangClient(fake.url), SGLangClient(fake.url)]
        router = Router(engines, dp_sizes=[1, 4])

        async def go() -> None:
            assert await engine_dp_sizes(engines) == [1, 1]  # SGLang without dp_size in its info: one rank
            for key in ("a", "b", "b"):
                async with router.request(key, sticky=True) as route:
                    await route.generate([5, 6, 7], params)
            for client in engines:
                await client.aclose()

        asyncio.run(go())
        with SyncEngineClient(fake.url) as sync:
            sync.generate([5, 6], params, data_parallel_rank=3)
        ranks = [body.get("data_parallel_rank", "absent") for body in fake.bodies("/generate")]
    # "a" on the single-rank engine 0 (nothing sent), "b" on engine 1's rank 0, twice.
    assert ranks == ["absent", 0, 0, 3]


@pytest.mark.slow
def test_sessions_on_a_real_engine(dense_dir: Path, tmp_path: Path) -> None:
    """Two embedded engines behind the router: sticky turns reach the engine their key is bound to."""
    launcher = EmbeddedLauncher()
    options = {"device": "cpu", "dtype": "float32", "torch_threads": 1, "startup_timeout_s": 120}
    try:
        # One launch call starts both engines at once.
        url0, url1 = launcher.launch([EngineSpec(str(dense_dir), options=options)] * 2, str(tmp_path))
        engines = [SGLangClient(url0), SGLangClient(url1)]
        router = Router(engines)
        params = SamplingParams(max_new_tokens=3, temperature=0.0)

        async def session(key: str, prompt: list[int]) -> list[str]:
            urls = []
            ids = list(prompt)
            for _ in range(3):
                async with router.request(key, sticky=True) as route:
                    out = await route.generate(ids, params)
                urls.append(route.engine.url)
                assert out.prompt_tokens == len(ids) and len(out.output_ids) == 3
                ids = ids + out.output_ids + [7]
            return urls

        async def go() -> list[list[str]]:
            try:
                assert await engine_dp_sizes(engines) == [1, 1]
                return await asyncio.gather(*(session(f"s{i}", [1 + i, 2, 3]) for i in range(4)))
            finally:
                for client in engines:
                    await client.aclose()

        per_session = asyncio.run(go())
    finally:
        launcher.shutdown()
    assert all(len(set(urls)) == 1 for urls in per_session)
    assert sorted(urls[0] for urls in per_session) == sorted([url0, url0, url1, url1])
    assert router.metrics()["router/active"] == 0
