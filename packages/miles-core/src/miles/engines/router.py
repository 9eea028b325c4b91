"""Session-affinity routing over a fixed fleet of rollout engines (in-process, thread-safe).

An engine's prefix cache (SGLang's radix cache, the embedded engine's session prefix cache)
saves prefill only if a session's next turn reaches the engine, and the data-parallel rank
inside it, that served the turn before. The :class:`Router` keeps that promise:

- A **sticky** request (a turn of a multi-turn session: the session server, a multi-turn
  generate function) carries a routing key, stable for the whole session. The first request
  with a new key goes to the engine with the fewest active requests and, inside it, to its
  least active data-parallel rank; the key stays bound there until :meth:`Router.forget`.
- A sticky request without a key raises :class:`RoutingKeyMissing`. There is no fallback to
  load-based placement: a missing key is a caller bug that would silently cost every later
  turn its cached prefix.
- A **non-sticky** request (single-turn work) goes to the least active engine and rank. It
  takes no key: a key there would mean the caller forgot ``sticky=True``, so it is refused.

Ties between engines (or ranks) go to the one with fewer bound keys (the sessions that will
come back), then the one that has been routed fewer requests (so an idle fleet is used in
turn, not engine 0 alone), then the lower index.

"Active" counts the requests between :meth:`Router.acquire` and :meth:`Router.release`;
``async with router.request(key, sticky=...) as route`` does both, releasing on errors
too. Placement and counting happen under one lock, so concurrent callers (the session
server's thread, rollout event loops) see each other's requests at once. The lock guards
bookkeeping only; it is never held across a network call.

``policy="load"`` ignores keys entirely: every request goes to the least active engine and
nothing is bound. It exists only as the baseline of ``benchmarks/prefix_affinity.py``
(what a plain least-loaded router does to a multi-turn workload); keys are still checked,
so a caller's bug fails the same way under both policies.

Engines with several data-parallel ranks are given by ``dp_sizes`` (:func:`engine_dp_sizes`
reads them from the engines); a route to one carries ``dp_rank`` (sent to SGLang as
``/generate``'s ``data_parallel_rank``). Single-rank engines get ``dp_rank=None`` so that
nothing extra is sent. The fleet is fixed for the router's
life: an engine that restarts keeps its index and URL.

Engines the driver supervises (:mod:`miles.engines.health`) may be quarantined: dead, hung,
or restarting. The router then places nothing there, and a sticky key bound there moves to
another engine (its cached prefix is lost with the engine). A request whose engine does not
answer (refused, disconnected, timed out, or cut by the quarantine of a hung engine) is sent
again, from scratch, to another engine, at most ``max_retries`` times; an error the engine
answers with (HTTP 4xx/5xx) is the request's own and is never retried. While every engine is
out, ``request`` waits for one (up to ``wait_s``) or raises the fleet's failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from miles.engines.client import EngineUnavailable
from miles.engines.health import board_for
from miles.errors import ConfigError, EngineError, MilesError

if TYPE_CHECKING:
    from miles.interfaces import EngineClient
    from miles.types import GenerateOutput, SamplingParams

Policy = Literal["affinity", "load"]
POLICIES: tuple[Policy, ...] = ("affinity", "load")


class RoutingError(MilesError):
    """A request cannot be routed as asked (bad key, release of a route never acquired)."""


class RoutingKeyMissing(RoutingError):
    """A sticky request came without a routing key (it would lose its session's cached prefix)."""


class NoEngineAvailable(EngineUnavailable):
    """Every engine of the router is quarantined right now (``request`` waits for one instead)."""


class Route:
    """Where one request goes: ``engines[engine_index]``, at ``dp_rank`` when the engine has several.

    A route from :meth:`Router.request` over supervised engines (see :mod:`miles.engines.health`)
    follows its request: when the engine dies or hangs under it, :meth:`generate` moves the route
    to another engine and sends the request again there.
    """

    __slots__ = ("_key", "_router", "_sticky", "dp_rank", "engine", "engine_index")

    def __init__(
        self,
        engine_index: int,
        engine: EngineClient,
        dp_rank: int | None = None,
        *,
        router: Router | None = None,
        key: str | None = None,
        sticky: bool = False,
    ) -> None:
        self.engine_index = engine_index
        self.engine = engine
        self.dp_rank = dp_rank
        self._router = router
        self._key = key
        self._sticky = sticky

    def __repr__(self) -> str:
        return f"Route(engine_index={self.engine_index}, dp_rank={self.dp_rank})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Route):
            return NotImplemented
        return (self.engine_index, self.engine, self.dp_rank) == (
            other.engine_index,
            other.engine,
            other.dp_rank,
        )

    __hash__ = None  # type: ignore[assignment]  # a route can move (see generate)

    async def generate(self, input_ids: list[int], params: SamplingParams, **kwargs: Any) -> GenerateOutput:
        """``engine.generate`` along this route (adds ``data_parallel_rank`` when the route names a rank).

        On a supervised engine that does not answer (died, hung, quarantined) the request is sent
        again from scratch on another engine: nothing of the lost attempt is kept, so every token
        still comes from one engine call. A sticky session moves with it (its next turns follow;
        the new engine's prefix cache does not hold the session, so that one turn prefills in full).
        """
        attempts = 0
        while True:
            call_kwargs = dict(kwargs)
            if self.dp_rank is not None:
                call_kwargs["data_parallel_rank"] = self.dp_rank
            board = board_for(self.engine.url)
            if board is None or self._router is None:
                return await self.engine.generate(input_ids, params, **call_kwargs)
            try:
                return await board.watched(
                    self.engine.url, self.engine.generate(input_ids, params, **call_kwargs)
                )
            except EngineUnavailable as exc:
                attempts += 1
                if attempts > self._router.max_retries:
                    raise EngineError(
                        f"request failed on {attempts} engines in turn (engine.max_request_retries "
                        f"{self._router.max_retries}); last: {exc}"
                    ) from exc
                board.report_failure(self.engine.url, exc)
                board.count_retry()
                await self._router._move(self)


async def engine_dp_sizes(engines: Sequence[EngineClient]) -> list[int]:
    """Each engine's number of data-parallel ranks: ``dp_size`` in its ``/get_server_info``.

    SGLang reports its server arguments there (``dp_size`` among them); the embedded engine
    reports 1. An engine that does not say (or whose client has no ``get_server_info``) has one rank.
    """

    async def info(engine: EngineClient) -> Any:
        ask = getattr(engine, "get_server_info", None)
        return await ask() if ask is not None else None

    infos = await asyncio.gather(*(info(engine) for engine in engines))
    sizes = []
    for engine, found in zip(engines, infos, strict=True):
        size = (found or {}).get("dp_size", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise EngineError(
                f"engine {engine.url}: /get_server_info reports dp_size {size!r}, not an integer >= 1"
            )
        sizes.append(size)
    return sizes


@dataclass
class _Rank:
    """Bookkeeping of one (engine, data-parallel rank) slot."""

    active: int = 0  # acquired, not yet released
    keys: int = 0  # routing keys bound here
    routed: int = 0  # requests acquired here, ever


class Router:
    """Routes requests to engines by session key (sticky) or by load; see the module docstring.

    ``engines[i]`` has ``dp_sizes[i]`` data-parallel ranks (default: one each).
    """

    def __init__(
        self,
        engines: Sequence[EngineClient],
        *,
        dp_sizes: Sequence[int] | None = None,
        policy: Policy = "affinity",
        max_retries: int = 3,
        wait_s: float = 600.0,
    ) -> None:
        if not engines:
            raise ConfigError("Router: needs at least one engine")
        if policy not in POLICIES:
            raise ConfigError(f"Router: policy {policy!r} is not one of {POLICIES}")
        if dp_sizes is None:
            dp_sizes = [1] * len(engines)
        if len(dp_sizes) != len(engines):
            raise ConfigError(
                f"Router: dp_sizes has {len(dp_sizes)} entries for {len(engines)} engines (one per engine)"
            )
        for i, size in enumerate(dp_sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"Router: dp_sizes[{i}] must be an integer >= 1, got {size!r}")
        self.engines = list(engines)
        self.dp_sizes = [int(s) for s in dp_sizes]
        self.policy: Policy = policy
        # Supervised engines only (miles.engines.health): how many times one request may move to
        # another engine, and how long a request may wait while every engine is out.
        self.max_retries = max_retries
        self.wait_s = wait_s
        self._ranks = [[_Rank() for _ in range(size)] for size in self.dp_sizes]
        self._bound: dict[str, tuple[int, int]] = {}  # key -> (engine index, rank index)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Router({len(self.engines)} engines, dp_sizes={self.dp_sizes}, policy={self.policy!r})"

    # ------------------------------------------------------------------ routing

    def route(self, key: str | None, *, sticky: bool) -> Route:
        """Where a request would go now, without counting it as active.

        A new sticky key is bound by this call (a later request with it goes to the same place).
        Raises :class:`RoutingKeyMissing` for a sticky request without a key, and
        :class:`RoutingError` for a non-sticky one with a key.
        """
        with self._lock:
            return self._route(key, sticky)

    def acquire(self, key: str | None, *, sticky: bool) -> Route:
        """:meth:`route`, and count the request as active there until :meth:`release`."""
        with self._lock:
            route = self._route(key, sticky)
            slot = self._slot(route)
            slot.active += 1
            slot.routed += 1
            return route

    def release(self, route: Route) -> None:
        """End a request started by :meth:`acquire` (exactly once per acquire)."""
        with self._lock:
            slot = self._slot(route)
            if slot.active == 0:
                raise RoutingError(
                    f"release: engine {route.engine_index} rank {route.dp_rank} has no active request "
                    "(released twice, or never acquired)"
                )
            slot.active -= 1

    @contextlib.asynccontextmanager
    async def request(self, key: str | None, *, sticky: bool) -> AsyncIterator[Route]:
        """``async with router.request(key, sticky=True) as route:`` one request, counted until the block exits."""
        route = await self._acquire_waiting(key, sticky)
        try:
            yield route
        finally:
            self.release(route)

    async def _acquire_waiting(self, key: str | None, sticky: bool) -> Route:
        """:meth:`acquire`, waiting while every (supervised) engine is quarantined."""
        while True:
            try:
                return self.acquire(key, sticky=sticky)
            except NoEngineAvailable:
                boards = {id(b): b for b in (board_for(e.url) for e in self.engines) if b is not None}
                if not boards:
                    raise
                # One fleet supervises a router's engines; its board says when one is back.
                await next(iter(boards.values())).wait_available(self.wait_s)

    async def _move(self, route: Route) -> None:
        """Re-place ``route`` (its engine is out): released where it was, acquired afresh, same key."""
        self.release(route)
        new = await self._acquire_waiting(route._key, route._sticky)
        route.engine_index, route.engine, route.dp_rank = new.engine_index, new.engine, new.dp_rank

    def forget(self, key: str) -> bool:
        """Unbind ``key`` (its session ended); True if it was bound. Its next request is placed afresh."""
        with self._lock:
            where = self._bound.pop(key, None)
            if where is None:
                return False
            engine, rank = where
            self._ranks[engine][rank].keys -= 1
            return True

    def placement(self, key: str) -> Route | None:
        """Where ``key`` is bound, or None (never seen, forgotten, or ``policy="load"``)."""
        with self._lock:
            where = self._bound.get(key)
            return None if where is None else self._make_route(*where)

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float]:
        """A snapshot: ``router/{requests_routed, active, keys}`` and per engine
        ``router/engine{i}/{active, keys, routed}``; engines with several ranks add
        ``router/engine{i}/dp{r}/{active, keys, routed}``."""
        with self._lock:
            out: dict[str, float] = {
                "router/requests_routed": float(sum(r.routed for ranks in self._ranks for r in ranks)),
                "router/active": float(sum(r.active for ranks in self._ranks for r in ranks)),
                "router/keys": float(len(self._bound)),
            }
            for i, ranks in enumerate(self._ranks):
                for field in ("active", "keys", "routed"):
                    out[f"router/engine{i}/{field}"] = float(sum(getattr(r, field) for r in ranks))
                if len(ranks) > 1:
                    for rank, slot in enumerate(ranks):
                        for field in ("active", "keys", "routed"):
                            out[f"router/engine{i}/dp{rank}/{field}"] = float(getattr(slot, field))
            return out

    # ------------------------------------------------------------------ internals (lock held)

    def _route(self, key: str | None, sticky: bool) -> Route:
        self._check_key(key, sticky)
        if not sticky or self.policy == "load":
            return self._make_route(*self._least_active(), key=key, sticky=sticky)
        assert key is not None  # _check_key
        where = self._bound.get(key)
        if where is not None and not self._available(where[0]):
            # Its engine died or hangs: the session moves (its cached prefix is lost with the engine).
            self._ranks[where[0]][where[1]].keys -= 1
            del self._bound[key]
            where = None
        if where is None:
            where = self._least_active()
            self._bound[key] = where
            self._ranks[where[0]][where[1]].keys += 1
        return self._make_route(*where, key=key, sticky=sticky)

    def _available(self, engine: int) -> bool:
        board = board_for(self.engines[engine].url)
        return board is None or board.is_available(self.engines[engine].url)

    @staticmethod
    def _check_key(key: str | None, sticky: bool) -> None:
        if key is not None and not isinstance(key, str):
            raise RoutingError(f"routing key must be a string, got {type(key).__name__} {key!r}")
        if sticky and not key:
            raise RoutingKeyMissing(
                "a sticky request (one turn of a multi-turn session) needs a routing key: a stable id for "
                f"the session, e.g. its session id; got {key!r}. Without it the turn could land on an "
                "engine that does not hold the session's prefix, so it is refused rather than routed by load"
            )
        if not sticky and key is not None:
            raise RoutingError(
                f"a non-sticky request is routed by load and takes no routing key (got {key!r}); "
                "pass sticky=True to keep the session on one engine"
            )

    def _least_active(self) -> tuple[int, int]:
        """The (engine, rank) for a request placed by load: least active, then fewer keys, fewer routed, lower index."""

        def load(slots: Sequence[_Rank]) -> tuple[int, int, int]:
            return (sum(s.active for s in slots), sum(s.keys for s in slots), sum(s.routed for s in slots))

        candidates = [i for i in range(len(self._ranks)) if self._available(i)]
        if not candidates:
            raise NoEngineAvailable(
                f"all {len(self.engines)} engines are quarantined (dead, hung or restarting)", url=""
            )
        engine = min(candidates, key=lambda i: (*load(self._ranks[i]), i))
        ranks = self._ranks[engine]
        rank = min(range(len(ranks)), key=lambda r: (*load([ranks[r]]), r))
        return engine, rank

    def _make_route(self, engine: int, rank: int, *, key: str | None = None, sticky: bool = False) -> Route:
        dp_rank = rank if self.dp_sizes[engine] > 1 else None
        return Route(engine, self.engines[engine], dp_rank, router=self, key=key, sticky=sticky)

    def _slot(self, route: Route) -> _Rank:
        index = route.engine_index
        if not 0 <= index < len(self._ranks) or route.engine is not self.engines[index]:
            raise RoutingError(f"route to engine {index} does not come from this router")
        rank = 0 if route.dp_rank is None else route.dp_rank
        if not 0 <= rank < self.dp_sizes[index] or (route.dp_rank is None) != (self.dp_sizes[index] == 1):
            raise RoutingError(
                f"route names rank {route.dp_rank} of engine {index}, which has {self.dp_sizes[index]} rank(s)"
            )
        return self._ranks[index][rank]
