"""Which engines of a supervised fleet may take requests, shared by every router of the run.

The driver's :class:`miles.driver.fleet.EngineFleet` owns one :class:`HealthBoard` for the
engines it launched or attached to. Routers, the fully asynchronous worker and the session
server each build their own clients (one per event loop), so the board is found by engine
URL (:func:`board_for`) rather than handed to each of them: an engine's health is a property
of its process, not of a client.

- :meth:`HealthBoard.quarantine` takes an engine out of routing and cuts every request in
  flight to it (on whatever event loop it runs): the request fails with
  :class:`~miles.engines.client.EngineUnavailable`, which the router retries elsewhere. A
  SIGSTOPped engine never answers, so cutting is the only way its requests come back.
- :meth:`HealthBoard.report_failure` is what a caller does when an engine did not answer
  (connection refused, disconnect, timeout): the engine is quarantined at once and the
  supervisor is woken to check it, restart it, or give up.
- :meth:`HealthBoard.admit` returns an engine to routing once it is healthy again and holds
  the fleet's weight version.
- :meth:`HealthBoard.fail` records that the fleet gave up (no engine left, restart budget
  spent); requests waiting for an engine then raise that one message.

Engines nobody supervises have no board: requests to them fail as they always did.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from miles.engines.client import EngineUnavailable, normalize_url
from miles.errors import EngineError

T = TypeVar("T")


@dataclass(eq=False)
class _Watch:
    """One request in flight to an engine: cancelled (on its own loop) if the engine is quarantined."""

    loop: asyncio.AbstractEventLoop
    task: asyncio.Future
    cut: str | None = None  # why the request was cut


@dataclass
class EngineState:
    index: int
    url: str
    available: bool = True
    reason: str | None = None  # why it is out of routing
    faults: int = 0
    watches: set[_Watch] = field(default_factory=set)


class HealthBoard:
    """The routing state of one fleet's engines (thread-safe; see the module docstring)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.engines = {normalize_url(u): EngineState(i, normalize_url(u)) for i, u in enumerate(urls)}
        self._lock = threading.Lock()
        self.wake = threading.Event()  # set when a caller reports a failure (the supervisor waits on it)
        self.failed: str | None = None
        self.retried_requests = 0
        self.faults = 0  # quarantines, ever (a fault the driver can compare before and after an update)

    # ------------------------------------------------------------- state

    def is_available(self, url: str) -> bool:
        state = self.engines.get(url)
        return state is not None and state.available

    def available_urls(self) -> list[str]:
        with self._lock:
            return [u for u, s in self.engines.items() if s.available]

    def quarantine(self, url: str, reason: str) -> bool:
        """Take ``url`` out of routing and cut its requests in flight; False if it already was out."""
        with self._lock:
            state = self.engines[url]
            fresh = state.available
            if fresh:
                state.available = False
                state.reason = reason
                state.faults += 1
                self.faults += 1
            watches = list(state.watches)
        for watch in watches:
            watch.cut = reason
            # A closed loop: nothing waits on that request any more.
            with contextlib.suppress(RuntimeError):
                watch.loop.call_soon_threadsafe(watch.task.cancel)
        return fresh

    def admit(self, url: str) -> None:
        with self._lock:
            state = self.engines[url]
            state.available, state.reason = True, None

    def report_failure(self, url: str, exc: BaseException) -> None:
        """A request found ``url`` unreachable: quarantine it now, let the supervisor decide the rest."""
        if url in self.engines:
            self.quarantine(url, f"a request failed: {exc}")
            self.wake.set()

    def count_retry(self) -> None:
        with self._lock:
            self.retried_requests += 1

    def fail(self, message: str) -> None:
        """The fleet gave up: every request waiting for an engine raises ``message``."""
        self.failed = message
        for url in list(self.engines):
            self.quarantine(url, message)

    # ------------------------------------------------------------- requests

    async def watched(self, url: str, call: Awaitable[T]) -> T:
        """Await ``call`` (a request to ``url``) so that quarantining the engine cuts it.

        A cut request raises :class:`EngineUnavailable`; cancelling the caller still cancels it.
        """
        state = self.engines[url]
        task = asyncio.ensure_future(call)
        watch = _Watch(asyncio.get_running_loop(), task)
        with self._lock:
            if not state.available:
                task.cancel()
                raise EngineUnavailable(f"engine {url} is quarantined: {state.reason}", url=url)
            state.watches.add(watch)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if watch.cut is not None and (current is None or not current.cancelling()):
                raise EngineUnavailable(f"engine {url} was quarantined: {watch.cut}", url=url) from None
            raise
        finally:
            with self._lock:
                state.watches.discard(watch)

    async def wait_available(self, timeout_s: float) -> None:
        """Wait until some engine is available; raise the fleet's failure, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.failed is not None:
                raise EngineError(self.failed)
            if any(s.available for s in self.engines.values()):
                return
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"no engine has been available for {timeout_s:g} s: "
                    + "; ".join(f"{s.url}: {s.reason}" for s in self.engines.values())
                )
            await asyncio.sleep(0.05)


_BOARDS: dict[str, HealthBoard] = {}
_BOARDS_LOCK = threading.Lock()


def register(board: HealthBoard) -> None:
    """Make ``board`` the one :func:`board_for` finds for its engines' URLs."""
    with _BOARDS_LOCK:
        for url in board.engines:
            _BOARDS[url] = board


def unregister(board: HealthBoard) -> None:
    with _BOARDS_LOCK:
        for url in board.engines:
            if _BOARDS.get(url) is board:
                del _BOARDS[url]


def board_for(url: str) -> HealthBoard | None:
    """The board that supervises the engine at ``url`` (None: nobody does)."""
    return _BOARDS.get(url)


async def call_each(engines: Sequence[Any], method: str, *args: Any) -> None:
    """``engine.method(*args)`` on every engine at once; supervised engines that are out are skipped,
    and one that does not answer is reported to its board instead of failing the whole call."""

    async def one(engine: Any) -> None:
        board = board_for(engine.url)
        if board is None:
            await getattr(engine, method)(*args)
            return
        if not board.is_available(engine.url):
            return
        try:
            await board.watched(engine.url, getattr(engine, method)(*args))
        except EngineUnavailable as exc:
            board.report_failure(engine.url, exc)

    await asyncio.gather(*(one(e) for e in engines))
