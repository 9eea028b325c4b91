"""Start (or attach to) rollout engines; implementations of :class:`miles.interfaces.EngineLauncher`.

- :class:`EmbeddedLauncher` runs ``python -m miles.engines.embedded`` processes.
- :class:`SGLangLauncher` attaches to running SGLang servers, or runs
  ``python -m sglang.launch_server`` when the ``sglang`` package is installed.

Both check requested ports before spawning anything, write one log file per
engine into ``log_dir``, wait for ``/health``, and on failure raise
:class:`miles.errors.EngineError` with the tail of the engine's log. An
``EngineSpec`` whose options carry ``url`` is attached to instead of launched.
Processes are stopped by :meth:`shutdown`, which also runs at interpreter exit.
"""

from __future__ import annotations

import abc
import atexit
import functools
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar, Literal

import httpx
from pydantic import BaseModel, Field, create_model

from miles.capabilities import ComponentOptions, EngineCapabilities
from miles.errors import ConfigError, EngineError
from miles.interfaces import EngineSpec

if TYPE_CHECKING:
    from miles.interfaces import EngineClient


class _EngineOptions(ComponentOptions):
    """What both built-in kinds take in ``engine.options`` (the driver fills in the first four)."""

    device: str | None = Field(None, description="cpu, cuda or cuda:N (default: engine.device)")
    dtype: str | None = Field(
        None, description="the engine's dtype (default: engine.dtype, else model.dtype)"
    )
    max_batch_size: int | None = Field(
        None, description="requests batched together (default: engine.max_batch_size)"
    )
    startup_timeout_s: float | None = Field(
        None, description="seconds to wait for /health (default: engine.startup_timeout_s)"
    )
    url: str | None = Field(
        None, description="attach to the engine already running there instead of launching one"
    )
    env: dict[str, str] | None = Field(None, description="extra environment variables of the engine process")
    handoff_dir: str | None = Field(
        None, description="directory of the colocated hand-off (set by the colocated transport)"
    )
    torch_threads: int | None = Field(None, description="torch threads of the engine process")
    seed: int | None = Field(None, description="sampling seed (default: run.seed; null: none)")


class EmbeddedOptions(_EngineOptions):
    """``engine.options`` of the embedded engine (``python -m miles.engines.embedded``)."""

    weight_version: int | None = Field(None, description="the weight version it starts at")
    update_timeout_s: float | None = Field(
        None, description="how long a staged multi-bucket update may wait for its next bucket"
    )
    log_level: str | None = Field(None, description="the engine's log level (DEBUG, INFO, ...)")
    prefix_cache_tokens: int | None = Field(
        None, description="KV tokens kept across requests for prefix reuse (0: off)"
    )
    kv_cache: Literal["auto", "paged", "dynamic"] | None = Field(
        None,
        description="paged: the fast GPU path (paged KV pool, chunked prefill, CUDA graphs; Qwen2/Qwen3 dense); "
        "dynamic: a DynamicCache per batch; auto (default): paged on CUDA where the model allows (docs/engine.md)",
    )
    mem_fraction: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="paged, CUDA: share of free GPU memory the KV pool takes (default 0.3)",
    )
    kv_tokens: int | None = Field(
        None, ge=0, description="paged: KV pool size in token slots (needed on CPU)"
    )
    chunk_tokens: int | None = Field(
        None, ge=0, description="paged: most prompt tokens one step prefills (0: 8192 on CUDA, 512 on CPU)"
    )
    block_size: int | None = Field(None, gt=0, description="paged: tokens per KV block (default 16)")
    cuda_graphs: bool | None = Field(
        None,
        description="paged: capture the decode step in CUDA graphs (default true; false runs it eagerly)",
    )
    overlap: bool | None = Field(
        None,
        description="paged: launch decode step N+1 before reading step N, hiding the host's work "
        "(default true; false reads every step before the next)",
    )
    max_loras: int | None = Field(
        None, ge=1, description="paged: LoRA adapters loaded at once (preallocated slots; default 4)"
    )
    max_lora_rank: int | None = Field(
        None, ge=1, description="paged: the largest LoRA rank an adapter slot holds (default 64)"
    )


class SGLangOptions(_EngineOptions):
    """``engine.options`` of SGLang servers (``sglang.launch_server``; ``url`` to attach)."""

    extra_args: list[Any] | None = Field(None, description="more sglang.launch_server flags")
    tp_size: int | None = Field(None, description="tensor-parallel size (--tp-size)")
    mem_fraction_static: float | None = Field(None, description="--mem-fraction-static")
    enable_return_routed_experts: bool | None = Field(
        None, description="return MoE routing (--enable-return-routed-experts)"
    )


EMBEDDED_OPTIONS = set(EmbeddedOptions.model_fields)
SGLANG_OPTIONS = set(SGLangOptions.model_fields)


# ------------------------------------------------------------------ ports


def port_is_free(host: str, port: int) -> bool:
    """True if nothing listens on ``host:port`` and it can be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", exclude: set[int] | None = None) -> int:
    """A port the OS says is free right now (another process could still take it before we do)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(100):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if not exclude or port not in exclude:
            return port
    raise EngineError(f"could not find a free port on {host}")


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def check_health(url: str, timeout_s: float = 10.0) -> None:
    """Raise EngineError unless ``url/health`` answers 200 within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while True:
            try:
                r = http.get(url.rstrip("/") + "/health")
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            if time.monotonic() >= deadline:
                raise EngineError(f"engine {url} is not healthy after {timeout_s:g} s ({last})")
            time.sleep(0.5)


# -------------------------------------------------------------- processes


@dataclass
class _Proc:
    url: str
    process: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]
    # How it was started, so that restart() can start it again the same way (same port: same URL).
    argv: list[str] | None = None
    env: dict[str, str] | None = None


class _ProcessLauncher(abc.ABC):
    """Shared bookkeeping: spawn, wait healthy, stop."""

    name = "engine"

    def __init__(self, *, startup_timeout_s: float = 180.0, python: str | None = None) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.python = python or sys.executable
        self._procs: list[_Proc] = []
        self._atexit = False

    # Attaching to running servers only health-checks them; it never needs the full start-up time.
    attach_timeout_cap_s: float | None = None
    # Options that only configure an engine process this launcher starts. A server that is
    # attached to was configured when it started, so a value for one of these is refused there
    # rather than silently ignored. The options the driver fills in for every engine (device,
    # dtype, max_batch_size, startup_timeout_s, delta_root) and the built-in recipes' torch_threads
    # are not listed: they describe the run, not a request to the server.
    launch_only_options: frozenset[str] = frozenset({"seed", "env"})
    # How to set those options on a server started by hand (for the refusal message).
    launch_flags_hint = "start it with the matching flags"
    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()

    def client(self, url: str) -> EngineClient:
        """Both built-in kinds serve SGLang's native HTTP API, so they share its client."""
        from miles.engines.client import SGLangClient

        return SGLangClient(url)

    def launch(self, specs: list[EngineSpec], log_dir: str) -> list[str]:
        """Attach when every spec carries a ``url`` option, else start one process per spec."""
        self._check_options(specs)
        if not specs:
            return []
        timeout = float(specs[0].options.get("startup_timeout_s") or self.startup_timeout_s)
        if all("url" in s.options for s in specs):
            self._check_attach_options(specs)
            cap = self.attach_timeout_cap_s
            return _attach(specs, timeout if cap is None else min(timeout, cap))
        if any("url" in s.options for s in specs):
            raise ConfigError(f"{self.name} engines: give every engine a url (attach) or none (launch)")
        return self._start(specs, log_dir, timeout)

    @abc.abstractmethod
    def _start(self, specs: list[EngineSpec], log_dir: str, timeout: float) -> list[str]:
        """Start the engine processes and return their URLs once healthy."""

    @abc.abstractmethod
    def _allowed_options(self) -> set[str]:
        """The ``EngineSpec.options`` keys this launcher understands."""

    def module_command(self, module: str, spec: EngineSpec, port: int, flags: Mapping[str, str]) -> list[str]:
        """``python -m module`` serving ``spec``'s model on its host and ``port``, exiting with this
        process (``--parent-pid``), plus ``flag value`` for every option in ``flags`` that is set."""
        argv = [
            self.python,
            "-m",
            module,
            "--model",
            str(spec.model_path),
            "--host",
            spec.host,
            "--port",
            str(port),
            "--parent-pid",
            str(os.getpid()),
        ]
        for key, flag in flags.items():
            if spec.options.get(key) is not None:
                argv += [flag, str(spec.options[key])]
        return argv

    @abc.abstractmethod
    def command(self, spec: EngineSpec, port: int) -> list[str]:
        """The command line of the engine process serving ``spec`` on ``port`` (what
        :meth:`start_processes` and the Ray engine actor run; usually :meth:`module_command`)."""

    def start_processes(
        self, specs: list[EngineSpec], log_dir: str, timeout: float, log_name: str = "engine"
    ) -> list[str]:
        """Start :meth:`command` for every spec on a free port, each logging to
        ``log_dir/<log_name>-i.log`` with its hand-off directory made; their URLs once healthy."""
        jobs = []
        for i, (spec, port) in enumerate(zip(specs, self._ports(specs), strict=True)):
            handoff = spec.options.get("handoff_dir")
            if handoff is not None:
                Path(handoff).mkdir(parents=True, exist_ok=True)
            log = Path(log_dir) / f"{log_name}-{i}.log"
            jobs.append((self.command(spec, port), _url(spec.host, port), log, spec.options.get("env")))
        self._launch_all(jobs, timeout)
        return [url for _, url, _, _ in jobs]

    def _check_options(self, specs: Sequence[EngineSpec]) -> None:
        allowed = self._allowed_options()
        for i, spec in enumerate(specs):
            unknown = sorted(set(spec.options) - allowed)
            if unknown:
                raise ConfigError(
                    f"{self.name} engine {i}: unknown option(s) {unknown}; allowed: {sorted(allowed)}"
                )

    def _check_attach_options(self, specs: Sequence[EngineSpec]) -> None:
        # None means "not set" (e.g. `engine.options.seed: null`), so only real values are refused.
        for i, spec in enumerate(specs):
            given = sorted(k for k in self.launch_only_options if spec.options.get(k) is not None)
            if given:
                raise ConfigError(
                    f"{self.name} engine {i} attaches to the running server at {spec.options['url']}, which "
                    f"cannot take option(s) {given}: they configure a server this launcher starts; "
                    f"{self.launch_flags_hint}, or set them to null in engine.options"
                )

    def _ports(self, specs: Sequence[EngineSpec]) -> list[int]:
        """Resolve every engine's port before anything starts: a taken port fails the launch at once."""
        ports: list[int | None] = [None] * len(specs)
        taken: set[int] = set()
        for i, spec in enumerate(specs):
            if spec.port is not None:
                if spec.port in taken or not port_is_free(spec.host, spec.port):
                    raise EngineError(
                        f"{self.name} engine {i}: port {spec.port} on {spec.host} is already in use; choose "
                        "another engine.port or leave it unset to pick free ports"
                    )
                ports[i] = spec.port
                taken.add(spec.port)
        for i, spec in enumerate(specs):
            if ports[i] is None:
                port = free_port(spec.host, exclude=taken)
                ports[i] = port
                taken.add(port)
        return [int(p) for p in ports if p is not None]

    def _spawn(self, argv: list[str], url: str, log_path: Path, env: dict[str, str] | None) -> _Proc:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            # A process group of its own: the terminal's Ctrl-C reaches only the driver, which stops
            # the engines itself once the step in flight is done (shutdown and atexit stop them; the
            # embedded engine also exits when the driver is gone).
            process = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                process_group=0,
            )
        except OSError as exc:
            log_file.close()
            raise EngineError(f"{self.name} engine: cannot start {argv[0]!r}: {exc}") from exc
        proc = _Proc(url=url, process=process, log_path=log_path, log_file=log_file, argv=argv, env=env)
        self._procs.append(proc)
        if not self._atexit:
            atexit.register(self.shutdown)
            self._atexit = True
        return proc

    def _wait_healthy(self, procs: list[_Proc], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(procs)
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while pending:
                for proc in list(pending):
                    code = proc.process.poll()
                    if code is not None:
                        raise EngineError(
                            f"{self.name} engine at {proc.url} exited with code {code} while starting; "
                            f"log {proc.log_path} ends with:\n{_tail(proc.log_path)}"
                        )
                    try:
                        if http.get(proc.url + "/health").status_code == 200:
                            pending.remove(proc)
                    except httpx.HTTPError:
                        pass
                if not pending:
                    return
                if time.monotonic() >= deadline:
                    proc = pending[0]
                    raise EngineError(
                        f"{self.name} engine at {proc.url} did not become healthy within {timeout_s:g} s; "
                        f"log {proc.log_path} ends with:\n{_tail(proc.log_path)}"
                    )
                time.sleep(0.25)

    def _launch_all(
        self, jobs: list[tuple[list[str], str, Path, dict[str, str] | None]], timeout_s: float
    ) -> None:
        started = [self._spawn(argv, url, log, env) for argv, url, log, env in jobs]
        try:
            self._wait_healthy(started, timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self._procs]

    # ------------------------------------------------------- fault tolerance

    def _proc(self, url: str) -> _Proc:
        for proc in self._procs:
            if proc.url == url:
                return proc
        raise EngineError(f"{self.name} launcher did not start an engine at {url}")

    def log_path(self, url: str) -> Path | None:
        """The log file of the engine this launcher started at ``url`` (None: not one of ours)."""
        try:
            return self._proc(url).log_path
        except EngineError:
            return None

    def exit_status(self, url: str) -> str | None:
        """How the engine at ``url`` ended ("exited with code 1", "killed by SIGKILL"); None while it runs."""
        code = self._proc(url).process.poll()
        if code is None:
            return None
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def restart(self, url: str, timeout_s: float | None = None) -> None:
        """Stop the engine at ``url`` (SIGKILL: it may be hung or stopped) and start it again, same
        command, port and log file; returns once it answers ``/health``."""
        old = self._proc(url)
        if old.argv is None:
            raise EngineError(f"{self.name} engine at {url} cannot be restarted (its command is unknown)")
        if old.process.poll() is None:
            old.process.kill()
        old.process.wait()
        old.log_file.write(
            f"\n===== miles: restarting this engine ({time.strftime('%H:%M:%S')}) =====\n".encode()
        )
        old.log_file.close()
        self._procs.remove(old)
        new = self._spawn(old.argv, url, old.log_path, old.env)
        try:
            self._wait_healthy([new], timeout_s or self.startup_timeout_s)
        except BaseException:
            if new.process.poll() is None:
                new.process.kill()
                new.process.wait()
            raise

    def shutdown(self) -> None:
        """Stop every engine this launcher started (SIGTERM, then SIGKILL after 10 s)."""
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.process.poll() is None:
                proc.process.terminate()
        deadline = time.monotonic() + 10.0
        for proc in procs:
            try:
                proc.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.process.kill()
                proc.process.wait()
            proc.log_file.close()


# The base of an engine kind whose engines are local processes, one per spec, answering ``/health``
# (a plugin's kind subclasses it: ``_start`` and ``_allowed_options``, and its own ``client``); it
# brings port checks, one log per engine, health waits, attaching by ``url``, restarts and shutdown.
ProcessLauncher = _ProcessLauncher


def _attach(specs: Sequence[EngineSpec], timeout_s: float) -> list[str]:
    urls = []
    for spec in specs:
        url = str(spec.options["url"]).rstrip("/")
        if "://" not in url:
            url = "http://" + url
        check_health(url, timeout_s)
        urls.append(url)
    return urls


# ------------------------------------------------------------- embedded


class _EmbeddedCapabilities:
    """``EmbeddedLauncher.capabilities``, on the class as on an instance: computed from what is installed."""

    def __get__(self, instance: object, owner: type | None = None) -> EngineCapabilities:
        from miles.engines.embedded.receivers import (
            BUILTIN_RECEIVERS,
            FLAT_BUILTIN_RECEIVERS,
            installed_receivers,
        )

        found = installed_receivers()
        return EngineCapabilities(
            receivers=BUILTIN_RECEIVERS | frozenset(found.loaded),
            flat_receivers=FLAT_BUILTIN_RECEIVERS | frozenset(n for n, r in found.loaded.items() if r.flat),
            unavailable=tuple(sorted(found.broken.items())),
            # Records the routers' choices whenever a request asks (MoE models; both KV paths).
            routing_capture=(),
        )


class _EmbeddedOptionsModel:
    """``EmbeddedLauncher.Options``: the engine's own options plus the launch options of the
    installed engine receivers (e.g. disk-delta's ``delta_root``), computed from what is installed.

    ``base`` is the part it always has: a recipe whose ``engine.options`` keys are all there is
    checked against it alone (``miles.config.options``), without importing the receivers."""

    base = EmbeddedOptions

    def __get__(self, instance: object, owner: type | None = None) -> type[BaseModel]:
        from miles.engines.embedded.receivers import installed_receivers

        options = tuple(
            sorted((o.name, o.help) for r in installed_receivers().loaded.values() for o in r.options)
        )
        return _embedded_options(options)


@functools.cache
def _embedded_options(receiver_options: tuple[tuple[str, str], ...]) -> type[BaseModel]:
    if not receiver_options:
        return EmbeddedOptions
    fields: dict[str, Any] = {
        name: (str | None, Field(None, description=help)) for name, help in receiver_options
    }
    return create_model("EmbeddedOptions", __base__=EmbeddedOptions, __module__=__name__, **fields)


class EmbeddedLauncher(_ProcessLauncher):
    """Runs one ``python -m miles.engines.embedded`` process per spec.

    Spec options: ``device``, ``dtype`` (None: the model's), ``max_batch_size``,
    ``handoff_dir``, ``torch_threads``, ``seed``, ``weight_version``, the launch options of
    the installed engine receivers (e.g. disk-delta's ``delta_root``, see
    :mod:`miles.engines.embedded.receivers`), ``update_timeout_s``
    (how long a staged multi-bucket update may wait for its next bucket),
    ``prefix_cache_tokens`` (KV kept across requests for prefix reuse; 0 turns it off),
    ``startup_timeout_s``, ``log_level``, ``env`` (extra environment), or ``url``
    to attach to an engine that is already running.
    """

    name = "embedded"
    # The engine's own receivers (the broadcast weight group, which also takes a bucket as one
    # flat buffer, and the colocated hand-off directory) plus those of installed transport
    # distributions (disk-delta, p2p, ...), read when asked.
    capabilities = _EmbeddedCapabilities()
    Options = _EmbeddedOptionsModel()  # engine.options
    launch_only_options = frozenset(
        {
            "seed",
            "env",
            "weight_version",
            "prefix_cache_tokens",
            "update_timeout_s",
            "log_level",
            "kv_cache",
            "mem_fraction",
            "kv_tokens",
            "chunk_tokens",
            "block_size",
            "cuda_graphs",
            "overlap",
            "max_loras",
            "max_lora_rank",
        }
    )
    launch_flags_hint = "start it with the matching `python -m miles.engines.embedded` flags (seed: --seed)"

    def _allowed_options(self) -> set[str]:
        return set(self.Options.model_fields)

    def _check_options(self, specs: Sequence[EngineSpec]) -> None:
        # The engine's own options are known without importing the receivers (which import torch:
        # seconds); only a key outside them needs the receivers' options to be told apart from a typo.
        if all(set(spec.options) <= set(EmbeddedOptions.model_fields) for spec in specs):
            return
        super()._check_options(specs)

    def command(self, spec: EngineSpec, port: int) -> list[str]:
        o = spec.options
        flags = {
            "device": "--device",
            "dtype": "--dtype",
            "max_batch_size": "--max-batch-size",
            "handoff_dir": "--handoff-dir",
            "torch_threads": "--torch-threads",
            "seed": "--seed",
            "weight_version": "--weight-version",
            "update_timeout_s": "--update-timeout-s",
            "log_level": "--log-level",
            "prefix_cache_tokens": "--prefix-cache-tokens",
            "kv_cache": "--kv-cache",
            "mem_fraction": "--mem-fraction",
            "kv_tokens": "--kv-tokens",
            "chunk_tokens": "--chunk-tokens",
            "block_size": "--block-size",
            "max_loras": "--max-loras",
            "max_lora_rank": "--max-lora-rank",
        }
        from miles.engines.embedded.receivers import installed_receivers

        for receiver in installed_receivers().loaded.values():
            flags.update({option.name: option.flag for option in receiver.options})
        argv = self.module_command("miles.engines.embedded", spec, port, flags)
        if o.get("cuda_graphs") is False:
            argv.append("--no-cuda-graphs")
        if o.get("overlap") is False:
            argv.append("--no-overlap")
        return argv

    def _start(self, specs: list[EngineSpec], log_dir: str, timeout: float) -> list[str]:
        for i, spec in enumerate(specs):
            if not Path(spec.model_path).is_dir():
                raise EngineError(f"embedded engine {i}: model path {spec.model_path!r} is not a directory")
        return self.start_processes(specs, log_dir, timeout)


# --------------------------------------------------------------- sglang


def sglang_command(python: str, spec: EngineSpec, port: int) -> list[str]:
    """The ``sglang.launch_server`` command line for one spec (TP size, memory fraction, dtype, R3)."""
    o = spec.options
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(spec.model_path),
        "--host",
        spec.host,
        "--port",
        str(port),
    ]
    if o.get("dtype"):
        argv += ["--dtype", str(o["dtype"])]
    if o.get("tp_size"):
        argv += ["--tp-size", str(o["tp_size"])]
    if o.get("mem_fraction_static"):
        argv += ["--mem-fraction-static", str(o["mem_fraction_static"])]
    if o.get("enable_return_routed_experts"):
        argv += ["--enable-return-routed-experts"]
    if o.get("seed") is not None:  # SGLang's sampling seed flag; 0 is a seed, None is none
        argv += ["--random-seed", str(o["seed"])]
    argv += [str(a) for a in o.get("extra_args") or []]
    return argv


class SGLangLauncher(_ProcessLauncher):
    """Attaches to SGLang servers (spec option ``url``) or launches them if ``sglang`` is installed.

    Options used when launching: ``dtype``, ``tp_size``, ``mem_fraction_static``,
    ``enable_return_routed_experts``, ``seed`` (``--random-seed``), ``extra_args`` (more
    ``launch_server`` flags), ``env`` and ``startup_timeout_s``. An attached server refuses the
    options that only a launch can apply (``launch_only_options``). ``device``, ``max_batch_size``,
    ``handoff_dir`` and ``torch_threads`` belong to the embedded engine and are ignored.
    """

    name = "sglang"
    # SGLang joins a torch.distributed weight group (/init_weights_update_group); the other
    # receivers are the embedded engine's own endpoints.
    capabilities = EngineCapabilities(
        receivers=frozenset({"weight-group"}),
        # A server returns MoE routing only when started with --enable-return-routed-experts.
        routing_capture=(("enable_return_routed_experts", True),),
    )
    Options = SGLangOptions  # engine.options
    attach_timeout_cap_s = 60.0
    launch_only_options = frozenset(
        {"seed", "env", "tp_size", "mem_fraction_static", "enable_return_routed_experts", "extra_args"}
    )
    launch_flags_hint = "start it with the matching `sglang.launch_server` flags (seed: --random-seed)"

    def __init__(self, *, startup_timeout_s: float = 900.0, python: str | None = None) -> None:
        super().__init__(startup_timeout_s=startup_timeout_s, python=python)

    def _allowed_options(self) -> set[str]:
        return set(self.Options.model_fields)

    def command(self, spec: EngineSpec, port: int) -> list[str]:
        return sglang_command(self.python, spec, port)

    def _start(self, specs: list[EngineSpec], log_dir: str, timeout: float) -> list[str]:
        if importlib.util.find_spec("sglang") is None:
            raise EngineError(
                "engine.launcher is 'sglang' but the sglang package is not installed in this environment; "
                "install it with `pip install 'miles-core[sglang]'` (needs CUDA GPUs), or start SGLang "
                "servers yourself and list them in engine.urls"
            )
        return self.start_processes(specs, log_dir, timeout, log_name="sglang")
