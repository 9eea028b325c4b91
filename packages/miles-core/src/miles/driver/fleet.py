"""The supervised fleet of rollout engines: health checks, quarantine, restarts, weight catch-up.

The driver sees two calls: ``with engine_fleet(...) as fleet`` (launch or attach, then
supervise) and ``fleet.update_weights(backend, version)`` (push new weights and make sure every
engine serves them, recovering engines that died on the way). Everything else happens here:

- A supervisor thread checks every engine each ``engine.health_check_interval_s``: a process
  this run launched that has exited is dead; an engine whose ``/health`` does not answer within
  ``engine.health_timeout_s`` is hung (a SIGSTOPped process still accepts connections). A
  request that finds its engine unreachable wakes the supervisor at once.
- A dead or hung engine is quarantined (:mod:`miles.engines.health`): routers stop placing
  requests there and its requests in flight are cut and sent again, from scratch, to the
  other engines. It is then restarted (killed first if hung; same command, port and log
  file), within a budget of ``engine.max_restarts`` restarts for the whole run.
- A restarted engine holds the base checkpoint (version 0). It rejoins at once when the
  fleet serves version 0. Otherwise, when no other engine is serving (the only engine of the
  default recipe died mid-rollout, and the rollout cannot finish without it), it is caught up as
  soon as it is healthy: the trainer's weights are exported as a snapshot and that engine alone
  loads them at the fleet's version (:meth:`EngineFleet._catch_up`); under colocated placement
  the trainer is offloaded while the engines generate, so there it waits for the next update
  like an engine restarted while others serve, which that update brings to its version.
  The backend is the driver's: the fleet uses it only under ``backend_lock``, which the driver
  holds around its own backend calls, so a catch-up never runs alongside a train step, a
  checkpoint or an update. Before the next update the backend re-forms its transport's connections to the engines
  (``backend.reconnect_transport()``, reaching ``Transport.reconnect(engine_urls)`` on every
  rank; a broadcast weight group is formed anew with every engine in it), after waiting for
  restarts in progress so that they are included. Restarts need both: a backend or transport
  without them cannot rejoin a restarted engine, so the fleet turns restarts off (and refuses
  an explicit ``engine.max_restarts > 0``) before any engine starts.
- A weight update that fails, or leaves an engine at another version, after an engine fault is
  recovered: the dead engines are restarted, the trainer's weights are exported once as a
  Hugging Face snapshot, every engine not at the new version loads it
  (``/update_weights_from_disk``), and the versions are checked again. A failure without an
  engine fault is not an engine's doing and is raised as it is.
- The run stops, with one line naming the engine, how it ended and its log, when an engine
  cannot be restarted (budget spent, a launcher or transport that cannot restart it) and is
  needed, or when no engine is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from miles.capabilities import shares_devices
from miles.config.schema import MilesConfig
from miles.driver.services import rollout_engines
from miles.engines import health
from miles.engines.client import RELEASE_MEMORY, RESUME_MEMORY, EngineCall, SyncEngineClient
from miles.errors import ConfigError, EngineError
from miles.interfaces import EngineClient, TransportStats

log = logging.getLogger(__name__)


@dataclass
class FleetSettings:
    """How the fleet is supervised (from the ``engine`` section; see :func:`settings_from`)."""

    health_check_interval_s: float = 2.0  # 0: no supervision (no health checks, no restarts)
    health_timeout_s: float = 10.0
    max_restarts: int = 0
    restart_timeout_s: float = 180.0
    # Why engines are not restarted (None: they are, within max_restarts).
    no_restart_reason: str | None = None
    # Why a restarted engine cannot be caught up before the next weight update (None: it can).
    no_catch_up_reason: str | None = None


def rejoin_problem(config: MilesConfig) -> str | None:
    """Why a restarted engine could not take the run's next weight update (None: it can).

    Asked of the components themselves (loaded, not built): the backend must offer
    ``reconnect_transport()`` and the transport class ``reconnect(engine_urls)``.
    """
    from miles.plugins import load_component

    backend = load_component("backend", config.backend)
    if not callable(getattr(backend, "reconnect_transport", None)):
        return (
            f"backend {config.backend!r} cannot reconnect its transport to a restarted engine "
            "(it has no reconnect_transport())"
        )
    transport = load_component("transport", config.transport)
    if not callable(getattr(transport, "reconnect", None)):
        return (
            f"transport {config.transport!r} cannot re-form its connections to a restarted engine "
            "(it has no reconnect(); what it formed with the engines at start-up would not include it)"
        )
    return None


def settings_from(config: MilesConfig) -> FleetSettings:
    """Resolve ``engine.max_restarts: null``: restart where the launcher, backend and transport allow it.

    Raises ``ConfigError`` (one line) for an explicit ``engine.max_restarts > 0`` that cannot be
    honoured; the run calls this before any engine starts.
    """
    eng = config.engine
    reason = None
    if eng.urls:
        reason = (
            "the engines were attached to (engine.urls); Miles did not start them and cannot restart them"
        )
    elif config.placement.launcher == "ray":
        reason = "placement.launcher 'ray' does not restart engines yet"
    else:
        reason = rejoin_problem(config)
    if reason and eng.max_restarts:
        raise ConfigError(f"engine.max_restarts {eng.max_restarts}: {reason}; or set engine.max_restarts: 0")
    max_restarts = (0 if reason else 3) if eng.max_restarts is None else eng.max_restarts
    no_catch_up = None
    if shares_devices(config):
        # Offloaded while the engines generate, the trainer refuses every command but onload, and
        # onloading it then would compete with the engines for the shared devices.
        no_catch_up = "under colocated placement the trainer is offloaded while the engines generate"
    return FleetSettings(
        health_check_interval_s=eng.health_check_interval_s,
        health_timeout_s=eng.health_timeout_s,
        max_restarts=max_restarts,
        restart_timeout_s=eng.startup_timeout_s,
        no_restart_reason=reason if max_restarts == 0 else None,
        no_catch_up_reason=no_catch_up,
    )


@dataclass
class _Engine:
    index: int
    url: str
    # serving | suspect (a request failed there) | restarting | behind (restarted, waits for the
    # fleet's weights) | down (cannot be restarted; re-admitted if it comes back) | lost
    phase: str = "serving"
    fault_at: float | None = None  # when its current fault was detected
    fault: str | None = None
    starts: int = 0  # processes that rejoined: tells a catch-up whether its process is still the one


@dataclass
class Recovery:
    """One fault and how long the engine took to serve again (for metrics and the reliability table)."""

    engine: int
    fault: str
    seconds: float


@dataclass
class _Counters:
    restarts: int = 0
    faults: int = 0
    catch_ups: int = 0  # restarted engines brought to the fleet's version before the next update
    check_cpu_s: float = 0.0  # CPU time the supervisor thread spent on health checks (its whole cost here)
    recoveries: list[Recovery] = field(default_factory=list)


class EngineFleet:
    """The run's engines under supervision (see the module docstring)."""

    def __init__(
        self,
        urls: list[str],
        transport_options: dict[str, Any],
        launcher: Any,
        settings: FleetSettings,
        work_dir: str,
    ) -> None:
        self.urls = urls
        self.transport_options = transport_options
        self.lora_path: str | None = None  # a LoRA run: the adapter every generate request names
        # Multi-LoRA: the adapters (each stage's clients name theirs; an export holds <dir>/<name>/).
        self.lora_adapters: list[str] = []
        self.launcher = launcher
        self.settings = settings
        self.work_dir = work_dir
        self.board = health.HealthBoard(urls)
        self._engines = {u: _Engine(i, u) for i, u in enumerate(self.board.engines)}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._updating = False
        # The version the fleet serves, as of its last update (None: not updated yet; a resumed run
        # updates the engines before the fleet does, so the serving engines are asked then).
        self._version: int | None = None
        self._start_version: int | None = None
        self._counters = _Counters()
        # Engines (re)started since the start / since the backend last re-formed its transport's
        # connections: when the counts differ, the next update reconnects first.
        self._rejoined = 0
        self._reconnected = 0
        # Serializes use of the driver's backend: the driver holds it around its own backend calls
        # (training, scoring, checkpoints, exports) and update_weights takes it, so a catch-up from a
        # supervisor thread never runs alongside them. Re-entrant: the driver may hold it when it
        # calls update_weights. Order: backend_lock before _lock, never the other way round.
        self.backend_lock = threading.RLock()
        # The backend the weights come from, known from the first update_weights (until then the
        # fleet serves its start version, which a restarted engine already holds).
        self._backend: Any = None
        # Engines with a catch-up pending or running, and the thread doing it.
        self._catching_up: dict[str, threading.Thread] = {}
        self._threads: list[threading.Thread] = []
        self._http = httpx.Client(timeout=settings.health_timeout_s, trust_env=False)
        self._released = False  # the engines' KV caches are freed (engine.release_memory)

    # ------------------------------------------------------------ lifecycle

    @property
    def supervised(self) -> bool:
        return self.settings.health_check_interval_s > 0

    def start(self) -> None:
        if not self.supervised:
            return
        versions = set(self._versions().values())
        self._start_version = versions.pop() if len(versions) == 1 else None
        health.register(self.board)
        if self.settings.no_restart_reason:
            log.info("engine restarts are off: %s", self.settings.no_restart_reason)
        thread = threading.Thread(target=self._supervise, name="miles-engine-supervisor", daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        self._stop.set()
        self.board.wake.set()
        for thread in self._threads:
            # A restart in progress finishes first, so the launcher's shutdown sees its new process.
            thread.join(timeout=self.settings.restart_timeout_s)
        health.unregister(self.board)
        self._http.close()

    # ------------------------------------------------------------ driver API

    def clients(self) -> list[EngineClient]:
        """A client per engine, of the engine kind's own client class, for the calling event loop."""
        clients = [self.launcher.client(url) for url in self.urls]
        for client in clients:
            if self.lora_path is not None and hasattr(client, "lora_path"):
                client.lora_path = self.lora_path  # rollouts generate with the run's LoRA adapter
        return clients

    def update_weights(self, backend: Any, version: int) -> TransportStats:
        """``backend.update_weights(version)``, then every engine must serve ``version``.

        Engines that died or hung on the way are restarted and brought to ``version`` from a
        snapshot of the trainer's weights; see the module docstring.
        """
        with self.backend_lock:
            self._backend = backend
            return self._update_weights(backend, version)

    def _update_weights(self, backend: Any, version: int) -> TransportStats:
        t0 = time.perf_counter()
        faults_before = self.board.faults
        with self._lock:
            self._updating = True
            behind = [e.url for e in self._engines.values() if e.phase == "behind"]
        try:
            error: Exception | None = None
            stats: TransportStats | None = None  # None: the update raised before it reported
            try:
                self._reconnect_if_due(backend)
                stats = backend.update_weights(version)
            except Exception as exc:  # a rank or an engine failed; decided below whose fault it is
                error = exc
            wrong = self._wrong_versions(version)
            if error is None and not wrong:
                assert stats is not None  # no error: the backend returned its stats
                self._serve(version)
                return stats
            if self.supervised:
                self.sweep()
            engine_fault = self.board.faults != faults_before or bool(behind) or self._any_out()
            if not engine_fault:
                if error is not None:
                    raise error
                raise EngineError(f"after the weight update to version {version}, engines report {wrong}")
            self._recover(backend, version, error)
            seconds = time.perf_counter() - t0
            if stats is None:
                stats = TransportStats(bytes_sent=0, seconds=seconds, buckets=0, version=version)
            stats.metrics = {**stats.metrics, "recovered": 1.0}
            return stats
        finally:
            with self._lock:
                self._updating = False

    def _reconnect_if_due(self, backend: Any) -> None:
        """Engines came back since the transport connected: have the backend re-form its connections
        (after the restarts in progress, so that they are in) before the update must reach them."""
        reconnect = getattr(backend, "reconnect_transport", None)
        if not callable(reconnect):
            return  # restarts were turned off at start (settings_from); nothing can have rejoined
        with self._lock:
            restarting = any(e.phase == "restarting" for e in self._engines.values())
        if restarting:
            self._wait_settled()
        with self._lock:
            target = self._rejoined
            if target == self._reconnected:
                return
        log.warning("re-forming the transport's connections to the engines (an engine was restarted)")
        reconnect()
        with self._lock:
            self._reconnected = target

    def release_memory(self) -> None:
        """Free every serving engine's KV cache (``engine.release_memory``: colocated, after a rollout)."""
        self._memory_call(RELEASE_MEMORY)
        self._released = True

    def resume_memory(self) -> None:
        """Allocate the KV caches again before the engines generate (nothing to do unless released)."""
        if self._released:
            self._memory_call(RESUME_MEMORY)
            self._released = False

    def _memory_call(self, call: EngineCall) -> None:
        # A restarted engine comes up holding its memory; resuming it is a no-op, releasing it works.
        for url in self.board.available_urls():
            with SyncEngineClient(url, timeout=self.settings.restart_timeout_s) as client:
                client.call(call)

    def metrics(self) -> dict[str, float]:
        """Counters for the step's metrics (``engine/``): restarts, faults, retried requests, out now."""
        with self._lock:
            c = self._counters
            out = {
                "engine/restarts": float(c.restarts),
                "engine/faults": float(c.faults),
                "engine/retried_requests": float(self.board.retried_requests),
                "engine/quarantined": float(len(self.urls) - len(self.board.available_urls())),
                "engine/health_check_cpu_s": c.check_cpu_s,
                "engine/catch_ups": float(c.catch_ups),
            }
            if c.recoveries:
                out["engine/last_recovery_s"] = c.recoveries[-1].seconds
            return out

    @property
    def recoveries(self) -> list[Recovery]:
        with self._lock:
            return list(self._counters.recoveries)

    # ------------------------------------------------------------ supervision

    def _supervise(self) -> None:
        while not self._stop.is_set():
            self.board.wake.wait(self.settings.health_check_interval_s)
            self.board.wake.clear()
            if self._stop.is_set():
                return
            t_cpu = time.thread_time()
            try:
                self.sweep()
            except Exception:  # the supervisor must outlive one bad check; the next sweep retries
                log.exception("engine health check failed")
            finally:
                with self._lock:
                    self._counters.check_cpu_s += time.thread_time() - t_cpu

    def sweep(self) -> None:
        """Check every engine once and act on what changed (see the module docstring)."""
        for url, engine in list(self._engines.items()):
            if engine.phase in ("restarting", "lost") or self._stop.is_set():
                continue
            problem = self._probe(url)
            with self._lock:
                if engine.phase == "serving":
                    if problem is not None:
                        self._fault(engine, problem)
                    elif not self.board.is_available(url) and self.board.failed is None:
                        self.board.admit(
                            url
                        )  # a request failed but the engine is fine (a dropped connection)
                elif engine.phase == "behind" and problem is not None:
                    self._fault(engine, problem)
                elif engine.phase == "down" and problem is None:
                    self._rejoin(engine)  # an attached engine someone restarted

    def _probe(self, url: str) -> str | None:
        """None if the engine is fine, else what is wrong with it."""
        status = self._exit_status(url)
        if status is not None:
            return f"its process {status}"
        try:
            r = self._http.get(url + "/health")
        except httpx.TimeoutException:
            return f"hung: /health did not answer within {self.settings.health_timeout_s:g} s"
        except httpx.HTTPError as exc:
            # A killed process drops its connections a moment before it can be reaped: say how it ended.
            status = self._exit_status(url, wait_s=1.0)
            return f"its process {status}" if status is not None else f"unreachable: {exc!r}"
        if r.status_code != 200:
            return f"unhealthy: /health answered HTTP {r.status_code}"
        return None

    def _fault(self, engine: _Engine, problem: str) -> None:
        """Quarantine ``engine`` and restart it if the budget allows (lock held)."""
        self.board.quarantine(engine.url, problem)
        self._counters.faults += 1
        engine.fault, engine.fault_at = problem, time.monotonic()
        log.warning("engine %d at %s: %s; quarantined", engine.index, engine.url, problem)
        s = self.settings
        if s.no_restart_reason is not None or not callable(getattr(self.launcher, "restart", None)):
            engine.phase = "down"
        elif self._counters.restarts >= s.max_restarts:
            engine.phase = "lost"
            self._give_up(engine, f"restart budget spent (engine.max_restarts {s.max_restarts})")
            return
        else:
            engine.phase = "restarting"
            self._counters.restarts += 1
            thread = threading.Thread(
                target=self._restart, args=(engine,), name=f"miles-engine-restart-{engine.index}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        if not any(e.phase in ("serving", "restarting", "behind") for e in self._engines.values()):
            self._give_up(engine, "no engine is left")
            return
        self._catch_up_if_needed()  # the last serving engine may be the one that just went out

    def _restart(self, engine: _Engine) -> None:
        log.warning("engine %d at %s: restarting", engine.index, engine.url)
        try:
            self.launcher.restart(engine.url, self.settings.restart_timeout_s)
        except Exception as exc:
            with self._lock:
                engine.phase = "serving"  # so that _fault treats it as a new fault (and counts the budget)
                self._fault(engine, f"its restart failed: {exc}")
            return
        with self._lock:
            self._rejoin(engine)

    def _rejoin(self, engine: _Engine) -> None:
        """A (re)started engine: serve now if it holds the fleet's version, else wait for the next update."""
        self._rejoined += 1  # a new process: the transport's connections must be re-formed (lock held)
        engine.starts += 1
        try:
            held = SyncEngineClient(engine.url, timeout=self.settings.health_timeout_s).weight_version()
        except EngineError as exc:
            log.warning("engine %d at %s: no weight version after restart: %s", engine.index, engine.url, exc)
            held = -1
        if not self._updating and held == self._current_version(exclude=engine.url):
            self._admit(engine)
        else:
            engine.phase = "behind"
            log.warning(
                "engine %d at %s: back with weight version %d; rejoins at the next weight update"
                " unless it is caught up before (no other engine serving)",
                engine.index,
                engine.url,
                held,
            )
            self._catch_up_if_needed()

    # ------------------------------------------------------------ catch-up before the next update

    def _catch_up_if_needed(self) -> None:
        """No engine serves (lock held): catch the ones that are back but behind up now, since
        requests waiting for an engine would otherwise wait for an update that needs them done."""
        if self._updating or self._stop.is_set():
            return  # an update in progress brings every engine to its version itself
        if any(e.phase == "serving" for e in self._engines.values()):
            return  # the others carry the rollout; the next update brings it back
        behind = [e for e in self._engines.values() if e.phase == "behind" and e.url not in self._catching_up]
        if not behind:
            return
        reason = self.settings.no_catch_up_reason
        if reason is None and self._backend is None:
            reason = (
                "the fleet has no weights to catch up from yet"  # no update yet: it serves its start version
            )
        if reason is not None:
            log.warning(
                "no engine is serving and %s cannot be caught up before the next weight update (%s); "
                "requests wait for an engine",
                ", ".join(f"engine {e.index}" for e in behind),
                reason,
            )
            return
        for engine in behind:
            thread = threading.Thread(
                target=self._catch_up,
                args=(engine,),
                name=f"miles-engine-catch-up-{engine.index}",
                daemon=True,
            )
            self._catching_up[engine.url] = thread
            self._threads.append(thread)
            thread.start()

    def _catch_up(self, engine: _Engine) -> None:
        """Bring ``engine`` (restarted, behind) to the fleet's version from a snapshot, then admit it.

        Waits for the backend (``backend_lock``): the driver's backend calls come first, and no
        update can change the fleet's version while this runs. The engine was restarted, so the
        next update still re-forms the transport's connections first (``_reconnect_if_due``).
        """
        try:
            with self.backend_lock:
                with self._lock:
                    version, starts = self._version, engine.starts
                    if self._stop.is_set() or engine.phase != "behind" or version is None:
                        return  # an update admitted it meanwhile, or it failed again
                t0 = time.perf_counter()
                try:
                    self._bring_to(self._backend, version, [engine.url])
                except Exception as exc:  # the engine or the backend; which one, the checks below say
                    self._catch_up_failed(engine, version, starts, exc)
                    return
                with self._lock:
                    if engine.phase != "behind" or engine.starts != starts:
                        self._restarted_meanwhile(engine)
                        return
                    self._rejoin_checked(engine, version)  # admitted only if it reports ``version``
                    if engine.phase == "serving":
                        self._counters.catch_ups += 1
                        log.warning(
                            "engine %d at %s: caught up to weight version %d in %.1f s",
                            engine.index,
                            engine.url,
                            version,
                            time.perf_counter() - t0,
                        )
                    else:
                        self._catch_up_failed(engine, version, starts, None)
        finally:
            with self._lock:
                self._done_catching_up(engine)

    def _done_catching_up(self, engine: _Engine) -> None:
        # Only this thread's entry: a later restart of the engine may have started another catch-up.
        if self._catching_up.get(engine.url) is threading.current_thread():
            del self._catching_up[engine.url]

    def _restarted_meanwhile(self, engine: _Engine) -> None:
        """The engine went out while it loaded (lock held): the supervisor handles that fault, and a
        process that came back since has its own catch-up to do, which this one kept from starting."""
        self._done_catching_up(engine)
        self._catch_up_if_needed()

    def _catch_up_failed(self, engine: _Engine, version: int, starts: int, exc: Exception | None) -> None:
        problem = self._probe(engine.url)  # did the engine fail, or the catch-up?
        with self._lock:
            if self._stop.is_set():
                return  # the run is ending
            if engine.phase != "behind" or engine.starts != starts:
                self._restarted_meanwhile(engine)
                return
            self._done_catching_up(engine)  # before _fault: its restart may need a new catch-up
            if problem is not None:
                self._fault(engine, problem)  # a new fault of the engine: restarted within the budget
                return
            what = (
                f"loading weight version {version} failed: {exc}"
                if exc
                else f"it did not report version {version} after loading it"
            )
            if self.board.failed is None and not any(e.phase == "serving" for e in self._engines.values()):
                # Nothing else can finish the rollout: one line, instead of requests waiting out the router.
                engine.fault = f"restarted, but its catch-up failed ({what})"
                self._give_up(engine, "no engine is left")
            else:
                log.warning(
                    "engine %d at %s: catch-up failed (%s); rejoins at the next update",
                    engine.index,
                    engine.url,
                    what,
                )

    def _admit(self, engine: _Engine) -> None:
        if engine.fault_at is not None:
            seconds = time.monotonic() - engine.fault_at
            self._counters.recoveries.append(Recovery(engine.index, engine.fault or "", seconds))
            log.warning("engine %d at %s: serving again after %.1f s", engine.index, engine.url, seconds)
        engine.phase, engine.fault, engine.fault_at = "serving", None, None
        self.board.admit(engine.url)

    def _give_up(self, engine: _Engine, why: str) -> None:
        message = self.describe(engine.url, why)
        log.error("%s", message)
        self.board.fail(message)

    def describe(self, url: str, why: str) -> str:
        """One line: which engine, what happened to it, why the run cannot go on, where its log is."""
        engine = self._engines[url]
        status = self._exit_status(url)
        what = engine.fault or "failed"
        if status is not None and status not in what:
            what += f"; its process {status}"
        log_path = self._log_path(url)
        where = f"; its log: {log_path}" if log_path else ""
        return f"engine {engine.index} at {url}: {what}; {why}{where}"

    # ------------------------------------------------------------ recovery

    def _recover(self, backend: Any, version: int, error: Exception | None) -> None:
        """After an update hit an engine fault: restarts done, every engine at ``version``, or raise."""
        self._wait_settled()
        with self._lock:
            failed = self.board.failed
            gone = [e for e in self._engines.values() if e.phase in ("down", "lost")]
        if failed is not None:
            raise EngineError(failed) from error
        if gone:
            why = self.settings.no_restart_reason or "it could not be restarted"
            message = self.describe(gone[0].url, f"the weight update to version {version} needs it ({why})")
            self.board.fail(message)
            raise EngineError(message) from error
        behind = [u for u, v in self._versions().items() if v != version]
        if behind:
            self._bring_to(backend, version, behind)
        wrong = self._wrong_versions(version)
        if wrong:
            raise EngineError(
                f"after recovering the weight update to version {version}, engines report {wrong}"
            ) from error
        self._serve(version)

    def _wait_settled(self) -> None:
        """Wait for restarts in progress (each is bounded by the start-up timeout)."""
        deadline = time.monotonic() + self.settings.restart_timeout_s + 10.0
        while time.monotonic() < deadline:
            with self._lock:
                if not any(e.phase == "restarting" for e in self._engines.values()):
                    return
            time.sleep(0.1)

    def _bring_to(self, backend: Any, version: int, urls: list[str]) -> None:
        """Load the trainer's current weights into ``urls`` from a snapshot (any transport's engines)."""
        directory = os.path.join(self.work_dir, "engines", f"recovery-v{version}")
        log.warning("bringing %s to weight version %d from a snapshot", ", ".join(urls), version)
        shutil.rmtree(directory, ignore_errors=True)
        try:
            backend.export_hf(directory)
            for url in urls:
                with SyncEngineClient(url, timeout=self.settings.restart_timeout_s) as client:
                    if self.lora_path is not None:  # a LoRA run exports the adapter: load it by name
                        client.update_weight_version(version)
                        client.load_lora_adapter(self.lora_path, directory)
                    elif self.lora_adapters:  # multi-LoRA: every adapter, from its own directory
                        client.update_weight_version(version)
                        for name in self.lora_adapters:
                            client.load_lora_adapter(name, os.path.join(directory, name))
                    else:
                        client.update_weights_from_disk(directory, weight_version=version)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _serve(self, version: int) -> None:
        """Every engine holds ``version``: the ones waiting for it rejoin (each checked again, since
        one may have been restarted, with the base weights, since the versions were read)."""
        with self._lock:
            self._version = version
            for engine in self._engines.values():
                if engine.phase == "behind":
                    self._rejoin_checked(engine, version)

    def _rejoin_checked(self, engine: _Engine, version: int) -> None:
        try:
            held = SyncEngineClient(engine.url, timeout=self.settings.health_timeout_s).weight_version()
        except EngineError:
            return  # the supervisor will find out what is wrong with it
        if held == version:
            self._admit(engine)

    # ------------------------------------------------------------ engine queries

    def _versions(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for url in self._engines:
            try:
                with SyncEngineClient(url, timeout=self.settings.health_timeout_s) as client:
                    out[url] = client.weight_version()
            except EngineError:
                out[url] = None
        return out

    def _wrong_versions(self, version: int) -> list[tuple[str, int | None]]:
        return [(u, v) for u, v in self._versions().items() if v != version]

    def _current_version(self, exclude: str) -> int | None:
        if self._version is not None:
            return self._version
        held = [
            v for u, v in self._versions().items() if u != exclude and self._engines[u].phase == "serving"
        ]
        if not held:
            return self._start_version  # nothing serving to compare with: what the fleet started at
        return held[0] if all(v == held[0] for v in held) else None

    def _any_out(self) -> bool:
        with self._lock:
            return any(e.phase != "serving" for e in self._engines.values())

    def _exit_status(self, url: str, wait_s: float = 0.0) -> str | None:
        status = getattr(self.launcher, "exit_status", None)
        if status is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                found = status(url)
            except EngineError:  # not an engine this launcher started (attached)
                return None
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def _log_path(self, url: str) -> str | None:
        path = getattr(self.launcher, "log_path", None)
        return None if path is None else (str(p) if (p := path(url)) is not None else None)


@contextlib.contextmanager
def engine_fleet(config: MilesConfig, model_path: str, log_dir: str, work_dir: str) -> Iterator[EngineFleet]:
    """Launch (or attach to) the run's engines and supervise them for the duration of the block."""
    launched: dict[str, Any] = {}
    settings = settings_from(config)  # refuses an impossible engine.max_restarts before engines start
    with rollout_engines(
        config, model_path, log_dir, work_dir, on_launched=lambda launcher: launched.update(launcher=launcher)
    ) as (urls, transport_options):
        fleet = EngineFleet(urls, transport_options, launched.get("launcher"), settings, work_dir)
        lora = config.lora
        fleet.lora_path = lora.name if lora is not None and not lora.multi else None
        fleet.lora_adapters = list(lora.named()) if lora is not None and lora.multi else []
        fleet.start()
        try:
            yield fleet
        finally:
            fleet.close()
